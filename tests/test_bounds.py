"""Memory safety of kernels: reductions over empty dimensions, out-of-range indices.

Oracle: eager torch (values, or the error it raises).  A regression here used
to read out of bounds, which may crash the process instead of failing a test:
the cases that did run in a subprocess (:func:`_in_subprocess`), which prints
one line per case that matched eager, so a crash fails the test and names the
case it died in.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
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


END = "-- end of call --"


def _in_subprocess(*calls: str) -> list[list[str]]:
    """Run ``calls`` (Python, with this module imported) one after another in
    one fresh process; after checking it exited normally, the lines each
    printed (a process start is most of a case's time)."""
    code = "import tests.test_bounds as t\n" + "\n".join(
        f"t.{call}\nprint({END!r}, flush=True)" for call in calls
    )
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"exit status {done.returncode}:\n{output[-4000:]}"
    printed = done.stdout.split(END + "\n")
    assert len(printed) == len(calls) + 1 and printed[-1] == "", output[-4000:]
    return [p.splitlines() for p in printed[:-1]]


def test_reductions_over_an_empty_dimension_match_eager():
    calls = [f"_run_cases('EMPTY_REDUCTIONS', {dynamic})" for dynamic in (False, True)]
    for call, printed in zip(calls, _in_subprocess(*calls), strict=True):
        assert printed == [f"ok {name}" for name in EMPTY_REDUCTIONS], (call, printed)


TABLE = torch.randn(10, 4)
OUT_OF_RANGE = torch.tensor([1, 12])

# Ops that read or write at indices from data, each with an index past the
# end of its dimension (10 rows).  Eager raises; so must tilec, naming the op,
# instead of reading garbage or writing past the buffer.
INDEXING: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "aten.embedding": lambda w, i: F.embedding(i, w) * 2,
    "aten.index": lambda w, i: w[i] + 1,
    "aten.index_select": lambda w, i: w.index_select(0, i) * 2,
    "aten.gather": lambda w, i: torch.gather(w, 0, i.view(-1, 1).expand(-1, 4)) + 1,
    "aten.index_put": lambda w, i: w.index_put((i,), torch.ones(i.shape[0], 4), accumulate=True),
    "aten.scatter": lambda w, i: w.scatter(0, i.view(-1, 1), 5.0),
    "aten.scatter_add": lambda w, i: w.scatter_add(0, i.view(-1, 1), torch.ones(i.shape[0], 1)),
}


def _run_out_of_range(options: dict, dynamic: bool, index: list[int]) -> None:
    """Each INDEXING case with ``index``: an IndexError naming the op where eager
    raises; prints ``ok <op>`` per case."""
    for op, fn in INDEXING.items():
        torch._dynamo.reset()
        i = torch.tensor(index)
        try:
            fn(TABLE, i)
        except (IndexError, RuntimeError):
            pass
        else:
            raise AssertionError(f"eager accepts {index} in {op}")
        compiled = torch.compile(fn, backend="tilec", options=options, dynamic=dynamic)
        try:
            compiled(TABLE, i)
        except IndexError as err:
            assert "out of bounds for dimension 0" in str(err) and f"in {op}" in str(err), err
        else:
            raise AssertionError(f"tilec accepts {index} in {op}")
        print(f"ok {op}", flush=True)


def test_out_of_range_indices_raise_naming_the_op():
    """Kernels (static and generic sizes) and the reference interpreter;
    index 10**9 used to crash, 12 to read garbage, scatters skipped it."""
    calls = [
        "_run_out_of_range({}, False, [1, 12])",
        "_run_out_of_range({}, True, [1, 10**9])",
        "_run_out_of_range({'interpret': True}, False, [3, 12])",
    ]
    for call, printed in zip(calls, _in_subprocess(*calls), strict=True):
        assert printed == [f"ok {op}" for op in INDEXING], (call, printed)


# Negative indices: advanced indexing and index_put wrap them (as eager does);
# the others reject them.
NEGATIVE = torch.tensor([1, -10, -1])


def test_negative_indices_wrap_or_raise_as_in_eager():
    for op, fn in INDEXING.items():
        torch._dynamo.reset()
        try:
            expected = fn(TABLE, NEGATIVE)
        except (IndexError, RuntimeError):
            expected = None
        compiled = torch.compile(fn, backend="tilec")
        if expected is None:
            with pytest.raises(IndexError, match=f"in {op}"):
                compiled(TABLE, NEGATIVE)
        else:
            assert op in ("aten.index", "aten.index_put"), op
            assert_close_tree(compiled(TABLE, NEGATIVE), expected)


def test_indices_in_range_match_eager_everywhere():
    """The checks do not reject what is inside: every row once, and the ends."""
    index = torch.tensor([0, 9, 3, 9, 0, 5, -10, -1])
    for op, fn in INDEXING.items():
        torch._dynamo.reset()
        i = index if op in ("aten.index", "aten.index_put") else index.remainder(10)
        with torch.no_grad():
            assert_close_tree(torch.compile(fn, backend="tilec")(TABLE, i), fn(TABLE, i))


def _run_constant_indices(index: list[int]) -> None:
    """Each INDEXING case with ``index`` a constant of the compiled function
    (made inside it): eager's values where eager accepts it, else an
    IndexError naming the op; prints ``ok <op>`` per case."""
    for op, fn in INDEXING.items():
        torch._dynamo.reset()

        def constant(w: torch.Tensor, fn=fn) -> torch.Tensor:
            return fn(w, torch.tensor(index))

        try:
            expected = constant(TABLE)
        except (IndexError, RuntimeError):
            expected = None
        compiled = torch.compile(constant, backend="tilec")
        if expected is None:
            try:
                compiled(TABLE)
            except IndexError as err:
                assert f"in {op}" in str(err), err
            else:
                raise AssertionError(f"tilec accepts the constant {index} in {op}")
        else:
            with torch.no_grad():
                assert_close_tree(compiled(TABLE), expected)
        print(f"ok {op}", flush=True)


def test_constant_indices_fold_inside_and_raise_outside():
    """An index made inside the compiled function is a constant of the
    graph: its bounds check folded to the index, where it used to fail the
    compile (``check_index`` of constants computed as arithmetic, its
    message a str: ``index_select`` with ``torch.tensor([4])``, in
    transformers' Falcon); outside, the error stays for run time."""
    calls = [
        "_run_constant_indices([3])",
        "_run_constant_indices([2, 9])",
        "_run_constant_indices([12])",
    ]
    for call, printed in zip(calls, _in_subprocess(*calls), strict=True):
        assert printed == [f"ok {op}" for op in INDEXING], (call, printed)


def test_a_constant_index_into_a_symbolic_dimension_runs_generic(caplog):
    """Index 1 of a dimension of symbolic size ``s`` is inside for every
    size the generic variant runs (Dynamo specializes 0 and 1): its check
    folds, where comparing with ``s`` used to fail the generic compile."""

    def fn(x):
        return x.index_select(0, torch.tensor([1])) * 2

    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"max_specializations": 0})
    with caplog.at_level(logging.WARNING, logger="tilec.guards"):
        for n in (4, 6):
            x = torch.randn(n, 3)
            torch.testing.assert_close(compiled(x), fn(x))
    assert not [r.getMessage() for r in caplog.records if "no generic variant" in r.getMessage()]
