"""The user's pieces: DataProcessor, DataInterface and ModuleInterface.

These keep PyMarlin's names and signatures, so a PyMarlin recipe moves over
by changing its imports (see docs/migrating-from-pymarlin.md).
"""

from __future__ import annotations

import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

Batch = Any
TrainStepOutput = Union[torch.Tensor, tuple]


class RecipeError(ValueError):
    """A recipe piece (``get_train_dataloader``, ``get_optimizers_schedulers``,
    ``train_step``, ``val_step``...) broke its contract, found before the first step.
    ``sailfin train`` says it in one line, ``sailfin: recipe error: ...``, and exits 2;
    the message names the piece and how to fix it."""


class DataProcessor:
    """One step of preprocessing (read, clean, tokenize, write shards).

    Subclasses implement :meth:`process`; :meth:`multi_process_data` runs it over
    many inputs in a process pool, and with ``node_rank``/``num_nodes`` takes only
    this node's contiguous share of the inputs.

    Example::

        class Tokenize(DataProcessor):
            def process(self, path):
                return count_tokens(path)

        counts = Tokenize().multi_process_data(paths, process_count=4)
    """

    def __init__(self, node_rank: int = 0, num_nodes: int = 1) -> None:
        _check_node_split(node_rank, num_nodes)
        self.node_rank = node_rank
        self.num_nodes = num_nodes

    def process(self, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement process(*args)")

    def analyze(self) -> Any:
        """Optional: summarise what :meth:`process` did (counts, histograms...)."""
        return None

    def process_data(self, *args: Any) -> Any:
        """Run :meth:`process` then :meth:`analyze`; return what process returned."""
        result = self.process(*args)
        self.analyze()
        return result

    def node_share(self, inputs: Sequence[Any], node_rank: Optional[int] = None,
                   num_nodes: Optional[int] = None) -> list:
        """This node's contiguous part of ``inputs`` (balanced, order kept)."""
        # getattr: PyMarlin's processors often skip super().__init__() (one node then).
        node_rank = getattr(self, "node_rank", 0) if node_rank is None else node_rank
        num_nodes = getattr(self, "num_nodes", 1) if num_nodes is None else num_nodes
        _check_node_split(node_rank, num_nodes)
        inputs = list(inputs)
        base, extra = divmod(len(inputs), num_nodes)
        start = node_rank * base + min(node_rank, extra)
        stop = start + base + (1 if node_rank < extra else 0)
        return inputs[start:stop]

    def multi_process_data(self, inputs: Iterable[Any], *args: Any, process_count: int = 1,
                           node_rank: Optional[int] = None, num_nodes: Optional[int] = None,
                           mp_context: Optional[str] = None,
                           on_result: Optional[Callable[[Any], None]] = None) -> list:
        """Run :meth:`process` on each input of this node's share (a tuple is spread as
        ``*args``; extra ``args`` follow every input, as in PyMarlin:
        ``multi_process_data(files, out_dir, process_count=2)`` calls ``process(file,
        out_dir)``) and return the results in input order. Each worker receives the
        processor once and takes inputs in chunks of about 1/8 of its share; workers
        start by ``fork`` on Linux (``spawn`` would re-import torch in each): pass
        ``mp_context="spawn"`` if the parent runs threads. State that :meth:`process`
        sets on ``self`` stays in the worker. ``on_result`` is called here with each
        result, in input order, as it arrives (a progress line); see docs/recipes.md.
        """
        if not isinstance(process_count, int) or process_count < 1:
            raise ValueError(f"process_count must be an int >= 1, got {process_count!r} (pass "
                             "it by name: multi_process_data(inputs, *extra_args, "
                             "process_count=N))")
        share = self.node_share(list(inputs), node_rank, num_nodes)
        calls = [(x if isinstance(x, tuple) else (x,)) + args for x in share]
        results = []
        if process_count == 1 or len(calls) <= 1:
            for a in calls:
                results.append(self.process(*a))
                if on_result is not None:
                    on_result(results[-1])
        else:
            ctx = multiprocessing.get_context(mp_context or _default_start_method())
            workers = min(process_count, len(calls))
            chunk = math.ceil(len(calls) / (workers * 8))
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_set_worker_processor,
                                     initargs=(self,)) as pool:
                for result in pool.map(_call_worker_processor, calls, chunksize=chunk):
                    results.append(result)
                    if on_result is not None:
                        on_result(result)
        self.analyze()
        return results


# The processor of this worker process, set once when the worker starts.
_worker_processor: Optional[DataProcessor] = None


def _set_worker_processor(processor: DataProcessor) -> None:
    global _worker_processor
    _worker_processor = processor


def _call_worker_processor(args: tuple) -> Any:
    assert _worker_processor is not None, "worker started without its processor"
    return _worker_processor.process(*args)


def _default_start_method() -> str:
    # fork is cheap and keeps the parent's imports; macOS frameworks are not fork-safe.
    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return "fork"
    return multiprocessing.get_start_method(allow_none=False)


def _check_node_split(node_rank: int, num_nodes: int) -> None:
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(f"need 0 <= node_rank < num_nodes, got node_rank={node_rank}, "
                         f"num_nodes={num_nodes}")


class DataInterface:
    """Gives the trainer its datasets.

    Implement :meth:`get_train_dataset` and either :meth:`get_val_dataset` (one
    validation set) or :meth:`get_val_datasets` (name -> dataset).

    Example::

        class Digits(DataInterface):
            def get_train_dataset(self): return self.train
            def get_val_dataset(self): return self.val
    """

    def get_train_dataset(self, *args: Any, **kwargs: Any) -> torch.utils.data.Dataset:
        raise NotImplementedError(f"{type(self).__name__} must implement get_train_dataset()")

    def get_val_dataset(self, *args: Any, **kwargs: Any) -> Optional[torch.utils.data.Dataset]:
        return None

    def get_val_datasets(self, *args: Any, **kwargs: Any) -> dict[str, torch.utils.data.Dataset]:
        """Name -> dataset. The default wraps :meth:`get_val_dataset` as ``{"val": ...}``."""
        ds = self.get_val_dataset(*args, **kwargs)
        return {} if ds is None else {"val": ds}

    def get_test_dataset(self, *args: Any, **kwargs: Any) -> Optional[torch.utils.data.Dataset]:
        """Optional: the held-out set ``sailfin evaluate --split test`` (and ``predict``)
        reads; training never does."""
        return None

    def get_test_datasets(self, *args: Any, **kwargs: Any) -> dict[str, torch.utils.data.Dataset]:
        """Name -> held-out dataset. The default wraps :meth:`get_test_dataset` as
        ``{"test": ...}``."""
        ds = self.get_test_dataset(*args, **kwargs)
        return {} if ds is None else {"test": ds}


class ModuleInterface(nn.Module):
    """A training recipe: the model plus how to optimize, train and validate it.

    Required: :meth:`get_optimizers_schedulers`, :meth:`train_step`, and (to
    validate) :meth:`val_step`. If the module has a ``data`` attribute holding a
    :class:`DataInterface`, the default dataloader methods use it.

    Example::

        class Classifier(ModuleInterface):
            def __init__(self, data, lr=0.1):
                super().__init__()
                self.data, self.lr = data, lr
                self.net = nn.Linear(64, 10)

            def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
                return [torch.optim.SGD(self.parameters(), lr=self.lr)], []

            def train_step(self, global_step, batch, device):
                x, y = (t.to(device) for t in batch)
                return nn.functional.cross_entropy(self.net(x), y)

            def val_step(self, global_step, batch, device):
                x, y = (t.to(device) for t in batch)
                return {"pred": self.net(x).argmax(1), "label": y}

            def on_end_val_epoch(self, global_step, outputs, key="val"):
                return {"accuracy": (outputs["pred"] == outputs["label"]).float().mean().item()}
    """

    #: True while ``train_step`` runs a padding micro-batch: over several ranks, a
    #: rank whose share of an epoch's last step fills one micro-batch fewer than its
    #: partners' runs one sample with loss weight 0, so that every rank runs the same
    #: forwards. Leave such a batch out of counts the recipe keeps itself.
    padding_batch: bool = False
    #: True while the check before the first step runs ``val_step`` on
    #: ``trainer.sanity_val_batches`` batches (and ``on_end_val_epoch``, if asked below:
    #: its metrics are not logged, ``get_state()`` is put back after it).
    sanity_checking: bool = False
    #: True: the check before the first step also calls ``on_end_val_epoch`` on its
    #: outputs, so that an error in it shows before step 1. False (default): it only
    #: checks its signature (a callback that counts or saves would do it once too often).
    sanity_check_on_end_val_epoch: bool = False
    #: False: checkpoints and memory snapshots hold only the parameters that train (plus
    #: buffers, optimizer state and a fingerprint of the frozen rest); sailfin.hf sets it with peft.
    checkpoint_frozen_params: bool = True
    #: True: when one attribute (``self.net``) holds every weight, ``final/bare.safetensors``
    #: holds them under its own names (``net.load_state_dict(load_file(...))``); False: not.
    save_bare_weights: bool = True

    # -- required -------------------------------------------------------
    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int
                                  ) -> tuple[list[torch.optim.Optimizer], list]:
        raise NotImplementedError(
            f"{type(self).__name__} must implement get_optimizers_schedulers("
            "estimated_global_steps_per_epoch, epochs) -> (optimizers, schedulers)")

    def train_step(self, global_step: int, batch: Batch, device: torch.device
                   ) -> TrainStepOutput:
        """Return the MEAN loss over ``batch``, or ``(loss, {name: scalar tensor})``."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_step()")

    def val_step(self, global_step: int, batch: Batch, device: torch.device
                 ) -> dict[str, torch.Tensor]:
        """Return a dict of tensors whose first dimension is the batch. A 0-d tensor is
        the batch's mean: it counts once per sample of the batch, so its epoch mean is
        exact. PyMarlin's tuple return reaches ``on_end_val_epoch(global_step, *outputs,
        key=name)`` when that is its signature."""
        raise NotImplementedError(
            f"{type(self).__name__} has validation data but no val_step(); implement it")

    def predict_step(self, global_step: int, batch: Batch, device: torch.device
                     ) -> dict[str, Any]:
        """Optional (``sailfin predict``): this batch's predictions, a dict whose values
        hold one entry per sample (a tensor with the batch as first dimension, or a list).
        Each sample becomes one output row, with its ``id`` (its position in the split)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no predict_step(global_step, batch, device); "
            "implement it to return {name: one value per sample} for sailfin predict")

    # -- data -------------------------------------------------------------
    def get_train_dataloader(self, sampler: Callable[[Any], Any], batch_size: int
                             ) -> torch.utils.data.DataLoader:
        """Build the train loader. ``sampler(dataset)`` makes sailfin's sampler.

        Override to set ``collate_fn``, ``num_workers``... but keep
        ``batch_size=batch_size, sampler=sampler(dataset)``: sailfin plans which
        samples form each optimizer step.
        """
        ds = self._data().get_train_dataset()
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))

    def get_val_dataloaders(self, sampler: Callable[[Any], Any], batch_size: int
                            ) -> dict[str, torch.utils.data.DataLoader]:
        """Name -> loader. Keep ``batch_size`` and ``sampler(dataset)`` as given."""
        return {
            name: torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))
            for name, ds in self._data().get_val_datasets().items()
        }

    def get_test_dataloaders(self, sampler: Callable[[Any], Any], batch_size: int
                             ) -> dict[str, torch.utils.data.DataLoader]:
        """Name -> held-out loader (PyMarlin's name), read only by ``sailfin evaluate`` and
        ``sailfin predict`` (``--split test``). Keep ``batch_size`` and ``sampler(dataset)``."""
        data = getattr(self, "data", None)
        sets = data.get_test_datasets() if isinstance(data, DataInterface) else {}
        return {name: torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))
                for name, ds in sets.items()}

    def _data(self) -> DataInterface:
        data = getattr(self, "data", None)
        if data is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no 'data' attribute: store the DataInterface as "
                "self.data, or override get_train_dataloader/get_val_dataloaders")
        return data

    # -- callbacks (all optional) ---------------------------------------------
    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None: ...

    def on_end_train_step(self, global_step: int, loss: torch.Tensor,
                          stats: Optional[dict]) -> None:
        """After each optimizer step. ``stats`` is ``train_step``'s dict (or None); with
        PyMarlin's ``(loss, t1, t2...)`` return it is ``t1, t2...`` instead
        (``on_end_train_step(global_step, loss, t1, t2)``). A shorter signature, such as
        PyMarlin's ``(global_step, loss)``, gets what it takes."""

    def on_end_backward(self, global_step: int, loss: torch.Tensor) -> None:
        """After all micro-batches of a step ran backward, before clipping and stepping."""

    def on_end_train_epoch(self, global_step: int, epoch: int) -> None: ...

    def on_end_val_epoch(self, global_step: int, outputs: dict[str, Any], key: str = "val"
                         ) -> Optional[dict[str, float]]:
        """Turn the gathered validation outputs (dataset order) into metrics to log."""
        return None

    def on_end_train(self, global_step: int) -> None: ...

    # -- sharding (the fsdp backends) -------------------------------------------
    def configure_sharding(self, shard: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        """Choose this model's FSDP units yourself (instead of ``trainer.fsdp.units``).

        Call ``shard(submodule)`` on each unit, innermost first; it applies
        ``fully_shard`` with the run's mesh, mixed-precision and offload settings.
        The trainer shards the rest as the root unit afterwards. Only the ``fsdp``
        backends call this. Example::

            def configure_sharding(self, shard):
                for block in self.blocks:
                    shard(block)
                shard(self.embed)
        """

    def configure_callbacks(self) -> list:
        """Trainer callbacks (:class:`sailfin.Callback`) this recipe brings along, added to
        those passed to the Trainer: a packaged recipe's components that need the run
        (its output directory, its rank), e.g. ``sailfin.hf`` writing ``final/hf/``."""
        return []

    # -- state carried in checkpoints ----------------------------------------
    def get_state(self) -> dict:
        return {}

    def update_state(self, state: dict) -> None: ...
