import pytest
import torch

import tilec


def pytest_collection_modifyitems(config, items):
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
