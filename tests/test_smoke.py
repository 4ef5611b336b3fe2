import torch
import torch.nn.functional as F

import tilec
from tests.compare import assert_matches_eager


def test_mlp_matches_eager_and_fuses():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
    )
    x = torch.randn(4, 16)
    assert_matches_eager(lambda x: F.softmax(model(x), -1), x)
    s = tilec.stats()
    assert s["graphs"] == 1
    # gelu + layer norm is one kernel, softmax another; the linears are library calls.
    assert s["kernels"] == 2
    assert s["extern_calls"] == 2
    assert s["fallbacks"] == {}
