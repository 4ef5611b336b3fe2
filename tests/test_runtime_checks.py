"""Runtime checks in the graph (``torch._check``, ``torch._assert_async``)
raise as they do in eager, before anything reads with the size they assume;
a size decided by the data (``nonzero``, ``.item()``) is never assumed, even
where a check pinned it to a number.

Oracle: eager torch (its result, or the exception type it raises).  A run
that could read out of bounds if the check were lost runs in a subprocess,
so a regression fails the test instead of crashing pytest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tilec
from tests.compare import assert_close_tree, assert_matches_eager
from tilec.pipeline import programs


def _run_isolated(body: str, folder: Path) -> str:
    """``body`` as a script in ``folder``, run by a fresh Python process
    (data-dependent capture on); its stdout."""
    code = textwrap.dedent(
        """
        import torch, tilec
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        torch._dynamo.config.capture_scalar_outputs = True

        def outcome(fn, x):
            try:
                return repr(fn(x).tolist())
            except Exception as exc:
                return type(exc).__name__ + ": " + repr(str(exc))
        """
    ) + textwrap.dedent(body)
    script = folder / "case.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-3000:]}"
    return run.stdout


def test_a_nonzero_count_pinned_by_a_check_is_checked_on_every_call(tmp_path):
    out = _run_isolated(
        """
        def fn(x):
            z = x.nonzero()
            torch._check(z.size(0) == 4)
            return z + 1

        compiled = torch.compile(fn, backend="tilec")
        for x in (torch.ones(4), torch.zeros(4), torch.tensor([0.0, 1.0, 1.0, 0.0])):
            print(outcome(fn, x), outcome(compiled, x), sep=" | ")
        print(tilec.stats()["kernels"], sorted(tilec.stats()["fallbacks"]))
        """,
        tmp_path,
    )
    lines = out.splitlines()
    for line in lines[:3]:
        eager, compiled = line.split(" | ")
        assert compiled.split(":")[0] == eager.split(":")[0]
        assert eager.startswith("RuntimeError") or compiled == eager
    # Eager raises where the check fails; tilec too, naming the check's line.
    assert lines[1].startswith("RuntimeError")
    assert "torch._check(z.size(0) == 4)" in lines[1].split(" | ")[1]
    # The data-dependent graph runs in ATen: no kernel assumes the count.
    assert lines[3].startswith("0 ") and "aten.nonzero.default" in lines[3]


def test_an_item_pinned_by_a_check_is_checked_on_every_call(tmp_path):
    out = _run_isolated(
        """
        def fn(x):
            n = x.sum().int().item()
            torch._check(n == 3)
            return torch.arange(n) * 2

        compiled = torch.compile(fn, backend="tilec")
        for x in (torch.ones(3), torch.ones(5)):
            print(outcome(fn, x), outcome(compiled, x), sep=" | ")
        """,
        tmp_path,
    )
    for line in out.splitlines():
        eager, compiled = line.split(" | ")
        assert compiled.split(":")[0] == eager.split(":")[0]
        assert eager.startswith("RuntimeError") or compiled == eager
    assert out.splitlines()[1].startswith("RuntimeError")


def _positive_plus_one(x):
    torch._assert_async((x > 0).all(), "x must be positive")
    return x + 1


def test_an_assert_on_data_is_kept(tmp_path):
    assert_matches_eager(_positive_plus_one, torch.rand(4) + 0.5, options={"dump": str(tmp_path)})
    assert tilec.stats()["fallbacks"] == {"aten._assert_async.msg": 1}
    (graph_dir,) = tmp_path.iterdir()
    assert "fallback aten._assert_async.msg(" in (graph_dir / "00-lowered.txt").read_text()
    compiled = torch.compile(_positive_plus_one, backend="tilec")
    with pytest.raises(RuntimeError, match="x must be positive"):
        _positive_plus_one(-torch.ones(4))
    with pytest.raises(RuntimeError, match=r"x must be positive\n.*\n.*torch._assert_async\("):
        compiled(-torch.ones(4))


def _at_least_three(x):
    torch._check(x.shape[0] > 2)
    return x + 1


def test_a_check_on_sizes_a_variant_is_specialized_to_is_decided_when_compiling():
    options = {"specialize": "first"}
    compiled = torch.compile(_at_least_three, backend="tilec", dynamic=True, options=options)
    with torch.no_grad():
        for n in (4, 5, 4):
            x = torch.randn(n)
            assert_close_tree(compiled(x), _at_least_three(x))
    assert tilec.stats()["graphs"] == 2 and tilec.stats()["fallbacks"] == {}


def test_a_check_on_symbolic_sizes_runs_in_the_generic_variant(tmp_path):
    options = {"max_specializations": 0, "dump": str(tmp_path)}
    compiled = torch.compile(_at_least_three, backend="tilec", dynamic=True, options=options)
    with torch.no_grad():
        for n in (4, 5):
            x = torch.randn(n)
            assert_close_tree(compiled(x), _at_least_three(x))
    assert tilec.stats()["fallbacks"] == {"aten._assert_scalar.default": 1}
    (program,) = (p for name, p in programs().items() if name.endswith("_generic"))
    # Dynamo guards the size too; called directly, the program checks it itself.
    with pytest.raises(RuntimeError, match="s77 > 2|> 2"):
        program(2, torch.randn(2), sizes={program.plan.symbols[0].name: 2})
