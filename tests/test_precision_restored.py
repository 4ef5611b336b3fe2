"""conftest's ``fp32_precision_restored``: a test that changes the float32
precision settings leaves them as it found them for the next test.  The two
tests run in file order; run alone, the second checks nothing."""

from __future__ import annotations

import torch

SEEN: list[tuple[bool, bool, str]] = []


def _settings() -> tuple[bool, bool, str]:
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


def test_changes_the_precision_settings():
    SEEN.append(_settings())
    torch.set_float32_matmul_precision("medium")
    torch.backends.cuda.matmul.allow_tf32 = not SEEN[0][0]
    # (The public setter refuses once torch's test utilities are imported.)
    torch._C._set_cudnn_allow_tf32(not SEEN[0][1])


def test_the_next_test_sees_them_as_they_were():
    assert SEEN in ([], [_settings()])
