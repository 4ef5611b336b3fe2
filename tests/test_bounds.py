"""Memory safety of kernels: reductions over empty dimensions, out-of-range indices.

Oracle: eager torch (values, or the error it raises).  A regression here used
to read out of bounds, which may crash the process instead of failing a test:
the cases that did run in a subprocess (:func:`_in_subprocess`), which prints
one line per case that matched eager, so a crash fails the test and names the
case it died in.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.compare import assert_close_tree

ROOT = Path(__file__).resolve().parent.parent


def _empty_row() -> torch.Tensor:
    return torch.randn(2, 0, 16)


# Reductions over a dimension of size 0 in a kernel that also reads a value
# of the empty row (a softmax's or a layer norm's statistics): the kernel used
# to load element 0 of that empty buffer, masked only by the row mask.
EMPTY_REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "normalized sum": lambda x: (x / x.sum(-1, keepdim=True)).sum(1),
    "softmax sum": lambda x: torch.softmax(x, -1).sum(1),
    "softmax mean": lambda x: torch.softmax(x, -1).mean(1),
    "layer norm sum": lambda x: F.layer_norm(x, (16,)).sum(1),
    "layer norm prod": lambda x: F.layer_norm(x, (16,)).prod(1),
    # Full-size outputs of the empty tile too: stored with every lane masked off.
    "softmax over the empty dim": lambda x: (torch.softmax(x, 1), (x - x.amax(-1, True)).sum(1)),
    "any and all": lambda x: ((x / x.sum(-1, keepdim=True) > 0).any(1), (x > x.mean()).all(1)),
}


def _run_cases(table: str, dynamic: bool) -> None:
    """Run every case of ``table`` (a dict of this module) through tilec and
    eager; prints ``ok <name>`` per case that matches."""
    cases = globals()[table]
    for name, fn in cases.items():
        torch._dynamo.reset()
        x = _empty_row()
        with torch.no_grad():
            expected = fn(x)
            actual = torch.compile(fn, backend="tilec", dynamic=dynamic)(x)
        assert_close_tree(actual, expected)
        print(f"ok {name}", flush=True)


def _in_subprocess(call: str) -> str:
    """Run ``call`` (Python, with this module imported) in a fresh process;
    its output, after checking it exited normally."""
    code = f"import tests.test_bounds as t; t.{call}"
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"exit status {done.returncode}:\n{output[-4000:]}"
    return done.stdout


def test_reductions_over_an_empty_dimension_match_eager():
    for dynamic in (False, True):
        out = _in_subprocess(f"_run_cases('EMPTY_REDUCTIONS', {dynamic})")
        assert out.split("\n")[:-1] == [f"ok {name}" for name in EMPTY_REDUCTIONS], out
