"""OpInfo tier: every natively lowered op of torch's op database vs eager.

One test per op_db entry that supports float32 on CPU (see
tests/opinfo_sweep.py for how "natively lowered" is decided and which ops are
left out).  Ops tilec does not lower natively are skipped with the ATen ops
that block them; the full report is ``python tests/opinfo_sweep.py``.  To stay
within the suite's time budget each op runs its first ``MAX_SAMPLES`` samples,
compiled together as one graph.
"""

from __future__ import annotations

import pytest

# torch's op database imports expecttest, a test extra that a machine with
# torch alone may lack (the GPU machine): skip this file there, not fail the
# whole collection.
pytest.importorskip("expecttest", reason="torch's op database needs expecttest")

from tests.opinfo_sweep import float32_ops, main, op_name, sweep_op

MAX_SAMPLES = 4

# op name -> why it still fails.  Each entry is a strict xfail: fixing the bug
# makes the test fail until the entry is removed.
KNOWN_FAILURES: dict[str, str] = {}

OPS = {op_name(op): op for op in float32_ops()}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_FAILURES[n], strict=True))
        if n in KNOWN_FAILURES
        else n
        for n in OPS
    ],
)
def test_op_matches_eager(name):
    result = sweep_op(OPS[name], MAX_SAMPLES)
    if not result.native:
        pytest.skip(f"not lowered natively: {', '.join(result.unlowered)}")
    assert result.samples > 0
    assert not result.failures, "\n".join(result.failures)


def test_the_sweep_refuses_unknown_op_names(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--ops", "add,no_such_op,bernoulli"])
    assert exit.value.code == 2
    assert "unknown op name(s): bernoulli, no_such_op" in capsys.readouterr().err
