"""Encoding sample fields to bytes by extension, and decoding them back.

The extension's last part picks the codec (``x.npy`` -> ``npy``); the table is in
docs/streaming.md ("Decoding"). Pickle-based members (``pyd``, ``pickle``, ``pkl``)
stay bytes: unpickling can run code, so sailfin never does it for you.
"""

from __future__ import annotations

import io
import json
from typing import Any, Callable

import numpy as np

IMAGE_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "ppm": "PPM", "pgm": "PPM",
                 "pbm": "PPM", "pnm": "PPM", "bmp": "BMP", "gif": "GIF", "webp": "WEBP",
                 "tif": "TIFF", "tiff": "TIFF"}
INT_EXTS = ("cls", "cls2", "index", "inx", "id")
TEXT_EXTS = ("txt", "text")
DECODE_MODES = ("numpy", "pil", "raw")


def codec_name(ext: str) -> str:
    return ext.rsplit(".", 1)[-1].lower()


# -- encoding -----------------------------------------------------------------------------
def encode(ext: str, value: Any) -> bytes:
    """The bytes stored for ``value`` under extension ``ext`` (raises TypeError)."""
    kind = codec_name(ext)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if kind == "npy":
        buf = io.BytesIO()
        np.save(buf, _as_numpy(value), allow_pickle=False)
        return buf.getvalue()
    if kind in IMAGE_FORMATS:
        return _encode_image(value, IMAGE_FORMATS[kind])
    if kind == "pth":
        import torch

        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()
    if kind == "json":
        return json.dumps(value).encode()
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, np.bool_)):
        return str(int(value)).encode()
    if isinstance(value, (int, np.integer, float, np.floating)):
        return str(value).encode()
    if isinstance(value, (dict, list)):
        return json.dumps(value).encode()
    raise TypeError(f"cannot store a {type(value).__name__} as '.{ext}': use bytes, str, int, "
                    "a numpy array (.npy, .png, .jpg), a PIL image or a dict (.json)")


def _as_numpy(value: Any) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _encode_image(value: Any, fmt: str) -> bytes:
    image = value
    if not hasattr(value, "save"):
        array = _as_numpy(value)
        if array.dtype != np.uint8:
            raise TypeError(f"an image array must be uint8 to store it as {fmt}, got "
                            f"{array.dtype}: scale and convert it, or store it as .npy")
        image = _pil().fromarray(array)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


# -- decoding -----------------------------------------------------------------------------
Decoder = Callable[[bytes], Any]


def decoder_for(ext: str, mode: str) -> Decoder:
    """The function that decodes a member with extension ``ext`` in ``mode``."""
    if mode == "raw":
        return bytes
    kind = codec_name(ext)
    if kind == "npy":
        return _decode_npy
    if kind in IMAGE_FORMATS:
        return _image_decoder(IMAGE_FORMATS[kind], as_array=mode == "numpy")
    if kind in INT_EXTS:
        return int  # int(b"3") == 3
    if kind in TEXT_EXTS:
        return bytes.decode  # UTF-8
    if kind == "json":
        return json.loads
    if kind == "pth":
        return _decode_pth
    return bytes


_NPY_MAGIC = b"\x93NUMPY"
_npy_headers: dict[bytes, tuple[np.dtype, tuple, str, int]] = {}


def _decode_npy(data: bytes) -> np.ndarray:
    """``np.load(..., allow_pickle=False)`` without re-parsing a header seen before.

    The samples of one field share their header (same dtype and shape), and
    parsing it is most of ``np.load``'s cost for small arrays.
    """
    if data[:6] != _NPY_MAGIC or data[6:8] not in (b"\x01\x00", b"\x02\x00"):
        return np.load(io.BytesIO(data), allow_pickle=False)  # numpy names the problem
    start = 10 if data[6] == 1 else 12
    end = start + int.from_bytes(data[8:start], "little")
    header = data[start:end]
    known = _npy_headers.get(header)
    if known is None:
        known = _parse_npy_header(data[:end])
        if len(_npy_headers) < 1024:  # a handful of fields in practice; bounded anyway
            _npy_headers[header] = known
    dtype, shape, order, count = known
    if len(data) - end < count * dtype.itemsize:
        raise ValueError(f"the array needs {count * dtype.itemsize} bytes after its header, "
                         f"the member has {len(data) - end}")
    # A copy: frombuffer over bytes is read-only, and torch wants writable arrays.
    return np.frombuffer(data, dtype, count, end).reshape(shape, order=order).copy()


def _parse_npy_header(head: bytes) -> tuple[np.dtype, tuple, str, int]:
    buf = io.BytesIO(head)
    major, _ = np.lib.format.read_magic(buf)
    read = (np.lib.format.read_array_header_1_0 if major == 1
            else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read(buf)
    if dtype.hasobject:
        raise ValueError("the array holds Python objects, which need pickle: refused "
                         "(store numeric arrays)")
    return dtype, tuple(shape), "F" if fortran else "C", int(np.prod(shape, dtype=np.int64))


def _decode_pth(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _image_decoder(fmt: str, as_array: bool) -> Decoder:
    formats = (fmt,)

    def decode(data: bytes) -> Any:
        # Naming the format skips Pillow's probing of every registered plugin.
        image = _pil().open(io.BytesIO(data), formats=formats)
        if image.mode == "1":  # bit maps, palettes, CMYK: give pixels
            image = image.convert("L")
        elif image.mode in ("P", "CMYK"):
            image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        if not as_array:
            image.load()
            return image
        return np.array(image)  # writable (asarray's view of PIL's bytes is read-only)

    return decode


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("decoding or encoding images needs Pillow: "
                          "pip install 'sailfin[images]' (or pip install pillow)") from None
    return Image
