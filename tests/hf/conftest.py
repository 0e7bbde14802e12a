import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The example rows and tokenizer, written once for the whole session."""
    from tests.hf.helpers import MODULES, data

    path = tmp_path_factory.mktemp("hf-data")
    for task in MODULES:
        data(task, path)
    return path
