import os
import tempfile

import pytest
import torch

import tilec
from tilec.codegen.record import ENV as RECORD_KERNELS


def pytest_configure(config):
    """Record every kernel the session generates, for the PTX tier (tests/test_ptx.py)."""
    if not os.environ.get(RECORD_KERNELS):
        fd, path = tempfile.mkstemp(prefix="tilec-kernels-", suffix=".jsonl")
        os.close(fd)
        os.environ[RECORD_KERNELS] = path
        config.add_cleanup(lambda: os.unlink(path))


def pytest_collection_modifyitems(config, items):
    # The PTX tier compiles the kernels every other test generated: it runs last.
    items.sort(key=lambda item: item.path.name == "test_ptx.py")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and starts with zeroed tilec stats."""
    torch._dynamo.reset()
    tilec.reset_stats()
    yield
    torch._dynamo.reset()
