"""The streamed safetensors writer: safetensors and SafetensorsSource read back every byte,
the bytes are save_file's, and nothing half-written is ever left under the final name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from sailfin.checkpoint.errors import CheckpointError
from sailfin.backends.weights_file import SafetensorsSource
from sailfin.backends.weights_file import (SafetensorsWriter, TensorSpec, file_order,
                                             save_weights)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(5, 3, generator=g),
        "layer.bias": torch.randn(5, generator=g),
        "emb.weight": torch.randn(7, 4, generator=g).bfloat16(),
        "half": torch.randn(3, 2, generator=g).half(),
        "steps": torch.randint(-2**40, 2**40, (6,), generator=g),
        "scalar": torch.tensor(1.5),
        "scalar_int": torch.tensor(-3),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i32": torch.arange(-3, 3, dtype=torch.int32),
    }


def write_streamed(path, state, specs=None) -> None:
    specs = specs or file_order([TensorSpec.of(n, t) for n, t in state.items()])
    with SafetensorsWriter(str(path), specs) as out:
        for spec in specs:
            out.write(spec.name, state[spec.name])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def test_safetensors_and_the_source_read_back_every_tensor_bit_exact(tmp_path):
    state = tensors()
    path = tmp_path / "model.safetensors"
    write_streamed(path, state)
    loaded = load_file(str(path))
    assert loaded.keys() == state.keys()
    for name, value in state.items():
        assert same_bits(loaded[name], value), name
    with SafetensorsSource(str(path)) as source:
        assert sorted(source.names()) == sorted(state)
        for name, value in state.items():
            assert source.shape(name) == tuple(value.shape)
            assert same_bits(source.read(name), value), name
        assert same_bits(source.read("layer.weight", (slice(2, 4),)), state["layer.weight"][2:4])


def test_the_bytes_are_those_of_save_file(tmp_path):
    state = tensors()
    write_streamed(tmp_path / "streamed.safetensors", state)
    save_file(state, str(tmp_path / "whole.safetensors"), metadata={"format": "pt"})
    assert ((tmp_path / "streamed.safetensors").read_bytes()
            == (tmp_path / "whole.safetensors").read_bytes())


def test_any_order_reads_back_and_views_are_written_as_their_values(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "rows": base[1:3], "col": base[:, 2], "scalar": torch.tensor(7)}
    specs = [TensorSpec.of(n, t) for n, t in reversed(state.items())]  # not file_order
    write_streamed(tmp_path / "w.safetensors", state, specs)
    loaded = load_file(str(tmp_path / "w.safetensors"))
    for name, value in state.items():
        assert same_bits(loaded[name], value.contiguous()), name


def test_a_tensor_out_of_order_or_of_another_shape_is_refused_and_nothing_is_saved(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"the previous file")
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.int64, ())]
    for name, tensor, match in [("b", torch.tensor(1), "'a' torch.float32 \\[2\\] in the header"),
                                ("a", torch.zeros(3), "but 'a' torch.float32 \\[3\\]"),
                                ("a", torch.zeros(2, dtype=torch.float16), "torch.float16")]:
        with pytest.raises(CheckpointError, match=match):
            with SafetensorsWriter(str(path), specs) as out:
                out.write(name, tensor)
        assert path.read_bytes() == b"the previous file"
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_a_missing_tensor_or_an_error_leaves_no_file(tmp_path):
    path = tmp_path / "sub" / "w.safetensors"
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (1,))]
    with pytest.raises(CheckpointError, match="1 tensor\\(s\\) never written \\(b\\)"):
        with SafetensorsWriter(str(path), specs) as out:
            out.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="gather failed"):
        with SafetensorsWriter(str(path), specs) as out:
            out.write("a", torch.zeros(2))
            raise RuntimeError("gather failed")
    with pytest.raises(CheckpointError, match="one tensor more"):
        with SafetensorsWriter(str(path), specs[:1]) as out:
            out.write("a", torch.zeros(2))
            out.write("b", torch.zeros(1))
    assert list((tmp_path / "sub").iterdir()) == []


def test_a_dtype_safetensors_cannot_store_is_named_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match="'q' has dtype torch.complex128"):
        SafetensorsWriter(str(tmp_path / "w.safetensors"),
                          [TensorSpec("q", torch.complex128, (1,))])
    assert list(tmp_path.iterdir()) == []


def test_save_weights_keeps_tied_tensors_once_under_their_first_name(tmp_path):
    shared = torch.randn(3, 2)
    path = save_weights({"emb.weight": shared, "other": torch.ones(2), "head.weight": shared},
                        str(tmp_path / "w.safetensors"))
    assert sorted(load_file(path)) == ["emb.weight", "other"]
