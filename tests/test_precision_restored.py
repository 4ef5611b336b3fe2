"""conftest's ``float32_precision_kept``, which every test runs in: a test
that changes the float32 precision settings leaves them as it found them."""

from __future__ import annotations

import torch

from tests.conftest import float32_precision_kept


def _settings() -> tuple[bool, bool, str]:
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


def test_changed_precision_settings_are_restored():
    before = _settings()
    with float32_precision_kept():
        torch.set_float32_matmul_precision("medium")
        torch.backends.cuda.matmul.allow_tf32 = not before[0]
        # (The public setter refuses once torch's test utilities are imported.)
        torch._C._set_cudnn_allow_tf32(not before[1])
        # (The matmul precision cannot be read in this mixed state.)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (
            not before[0],
            not before[1],
        )
    assert _settings() == before
