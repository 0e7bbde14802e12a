import pytest

from sailfin import DataInterface, DataProcessor


class Square(DataProcessor):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.analyzed = 0

    def process(self, x, offset=0):
        return x * x + offset

    def analyze(self):
        self.analyzed += 1


def test_process_data_runs_process_then_analyze():
    p = Square()
    assert p.process_data(3) == 9 and p.analyzed == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_multi_process_keeps_input_order(workers):
    inputs = list(range(20)) + [(3, 100)]
    out = Square().multi_process_data(inputs, process_count=workers)
    assert out == [i * i for i in range(20)] + [109]


class Tag(DataProcessor):
    def process(self, path, kind, suffix="!"):
        return f"{kind}:{path}{suffix}"


@pytest.mark.parametrize("workers", [1, 2])
def test_multi_process_takes_pymarlins_extra_arguments(workers):
    """PyMarlin's form: multi_process_data(files, "text", process_count=2) calls
    process(file, "text") for each file."""
    out = Tag().multi_process_data(["a", "b", "c"], "text", process_count=workers)
    assert out == ["text:a!", "text:b!", "text:c!"]
    assert Tag().multi_process_data([("a", "csv")], "?") == ["csv:a?"]  # tuple, then extras
    with pytest.raises(ValueError, match="pass it by name"):
        Tag().multi_process_data(["a"], "text", process_count="2")


def test_node_split_is_contiguous_and_complete():
    inputs = list(range(10))
    shares = [Square(node_rank=r, num_nodes=3).multi_process_data(inputs) for r in range(3)]
    assert shares == [[0, 1, 4, 9], [16, 25, 36], [49, 64, 81]]
    assert Square().multi_process_data(inputs, node_rank=2, num_nodes=3) == shares[2]


def test_bad_node_split_and_process_count():
    with pytest.raises(ValueError, match="node_rank=3, num_nodes=3"):
        Square(node_rank=3, num_nodes=3)
    with pytest.raises(ValueError, match="process_count must be an int >= 1"):
        Square().multi_process_data([1], process_count=0)


def test_data_interface_defaults():
    class One(DataInterface):
        def get_train_dataset(self):
            return [1]

        def get_val_dataset(self):
            return [2]

    assert One().get_val_datasets() == {"val": [2]}
    with pytest.raises(NotImplementedError, match="get_train_dataset"):
        DataInterface().get_train_dataset()


class CountingPickles(DataProcessor):
    """Counts how often it is pickled (in this, the parent, process)."""

    pickled = 0

    def __init__(self):
        super().__init__()
        self.table = list(range(10_000))  # the kind of state a tokenizer carries

    def __getstate__(self):
        type(self).pickled += 1
        return self.__dict__

    def process(self, x):
        return self.table[x] * 2


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_get_the_processor_once_not_per_chunk(start_method):
    import multiprocessing

    if start_method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{start_method} is not available here")
    CountingPickles.pickled = 0
    out = CountingPickles().multi_process_data(range(200), process_count=2,
                                               mp_context=start_method)
    assert out == [2 * x for x in range(200)]
    # fork: inherited, never pickled; spawn: once per worker (was: once per chunk).
    assert CountingPickles.pickled <= (0 if start_method == "fork" else 2)
