"""The notebooks run as tests (nbmake) with small settings; they load the offline SmolLM2, hence `slow`."""

import os

import pytest

os.environ.setdefault("SPARSEKV_NOTEBOOK_FAST", "1")  # read by each notebook; the kernel inherits it


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
