"""OpInfo tier: every natively lowered op of torch's op database vs eager.

One test per op_db entry that supports float32 on CPU (see
tests/opinfo_sweep.py for how "natively lowered" is decided and which ops are
left out).  Ops tilec does not lower natively are skipped with the ATen ops
that block them; the full report is ``python tests/opinfo_sweep.py``.  To stay
within the suite's time budget each op runs its first ``MAX_SAMPLES`` samples,
compiled together as one graph.
"""

from __future__ import annotations

import collections

import pytest

# torch's op database imports expecttest, a test extra that a machine with
# torch alone may lack (the GPU machine): skip this file there, not fail the
# whole collection.
pytest.importorskip("expecttest", reason="torch's op database needs expecttest")

import torch
from torch.testing._internal.opinfo.core import SampleInput

from tests.compare import run_tilec
from tests.opinfo_sweep import (
    as_function,
    closer_than_eager,
    compare,
    differs_before_tilec,
    float32_ops,
    gradients,
    main,
    op_name,
    samples_of,
    sweep_op,
)

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


def test_the_sweep_takes_other_dtypes(capsys):
    """bfloat16: ``addr``'s samples differ from eager's by more than torch's
    bfloat16 tolerances (tilec rounds once, eager per op) yet pass, as
    close to the op in float64 as eager; ``full`` raised in the
    interpreter before its constants were made in float32.  int32's
    ``cumsum`` with ``dtype=torch.int32`` came back int64."""
    assert main(["--dtype", "bfloat16", "--ops", "addr,full", "--max-samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "OpInfo sweep (bfloat16," in out and "failing ops" not in out
    assert main(["--dtype", "int32", "--ops", "cumsum"]) == 0
    out = capsys.readouterr().out
    assert "(int32, CPU, exact)" in out and "failing ops" not in out


def test_closer_than_eager_judges_by_the_float64_reference():
    reference = torch.tensor([1.0, 2.5, 3.0, float("inf")], dtype=torch.float64)
    eager = torch.tensor([1.0, 2.5, 3.0625, float("inf")], dtype=torch.bfloat16)
    assert closer_than_eager(eager.clone(), eager, reference)
    # 2.5078125 is 0.0078 from the reference, eager's worst 0.0625 away.
    closer = torch.tensor([1.0, 2.5078125, 3.0, float("inf")], dtype=torch.bfloat16)
    assert closer_than_eager(closer, eager, reference)
    farther = torch.tensor([1.25, 2.5, 3.0, float("inf")], dtype=torch.bfloat16)
    assert not closer_than_eager(farther, eager, reference)
    # Where the reference is not finite, tilec must be what eager is.
    assert not closer_than_eager(torch.tensor([1.0, 2.5, 3.0, 0.0]).bfloat16(), eager, reference)
    assert not closer_than_eager(eager.clone(), eager, None)


def test_a_sample_dynamo_already_computes_otherwise_is_named_so():
    """``torch.addcdiv(a, b, c, value=v)`` of a float64 ``a`` and float32
    factors: Dynamo rewrites it as a division in float32 (every backend
    gets that graph), eager divides in float64.  A tilec output that
    differs as the ``eager`` backend's does is labelled so; one that
    differs alone is not."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 5, dtype=torch.float64, generator=g)
    b, c = torch.randn(5, 5, generator=g) * 3, torch.randn(1, 5, generator=g)

    def fn(a, b, c):
        return torch.addcdiv(a, b, c, value=-3.14)

    ins = [a, b, c]
    case = (0, fn, ins, fn(*ins), None)
    tolerance = (None, None)  # torch's, for float64
    assert compare(run_tilec(fn, *ins), case[3], None, tolerance) is not None
    where = differs_before_tilec(case, False, False, tolerance)
    assert where == "differs before tilec (Dynamo, backend 'eager' too)"
    same = (0, torch.sin, [a], torch.sin(a), None)
    assert differs_before_tilec(same, False, False, tolerance) is None


def test_a_sample_is_one_call_of_its_tensors():
    """``as_function``: the sample's tensors, in order, are the function's
    arguments and every other leaf is kept (nested lists, keyword
    arguments, None); a tensor inside any other container is refused by
    name, not turned into a constant."""
    x, y, w = torch.randn(2, 3), torch.randn(2, 3), torch.randn(3)
    sample = SampleInput([x, y], args=(1,), kwargs={"out": None})
    fn, tensors = as_function(torch.cat, sample)
    assert [id(t) for t in tensors] == [id(x), id(y)]
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    assert torch.equal(fn(a, b), torch.cat([a, b], 1))
    sample = SampleInput(x, args=([w, None],), kwargs={"alpha": 2.0})
    fn, tensors = as_function(lambda t, pair, alpha: t * pair[0] * alpha, sample)
    assert [id(t) for t in tensors] == [id(x), id(w)]
    assert torch.equal(fn(a, w), a * w * 2.0)
    Pair = collections.namedtuple("Pair", "first second")
    with pytest.raises(TypeError, match="a sample's Pair holds tensors"):
        as_function(torch.add, SampleInput(x, args=(Pair(w, 1),)))


def test_an_op_whose_samples_cannot_be_made_is_reported_not_fatal():
    """OpInfo's ``where`` makes a bool condition with ``requires_grad`` among
    its reference inputs, which raises: the sweep reports that op and goes
    on to the next."""
    (where,) = [op for op in float32_ops() if op_name(op) == "where"]
    result = sweep_op(where, 4, grad=True, inputs="reference")
    assert not result.native
    assert result.unlowered == ("<OpInfo cannot make its reference inputs: ValueError>",)


def test_an_output_eager_overflowed_is_judged_by_the_float64_reference():
    """float16 ``soft_margin_loss``: eager overflows to inf where float64
    (and tilec, computing in float32) gives 7.64: tilec passes when it is
    the reference within float16's tolerances, not when it is off or
    overflows too differently."""
    reference = torch.tensor([7.640625, 1.0], dtype=torch.float64)
    eager = torch.tensor([float("inf"), 1.0], dtype=torch.float16)
    assert closer_than_eager(torch.tensor([7.640625, 1.0]).half(), eager, reference)
    assert not closer_than_eager(torch.tensor([7.7, 1.0]).half(), eager, reference)
    assert not closer_than_eager(torch.tensor([float("nan"), 1.0]).half(), eager, reference)
    assert closer_than_eager(eager.clone(), eager, reference)  # eager's own overflow


def test_the_sweep_compares_gradients(capsys):
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = torch.tensor([0.5, 0.5, 0.5])  # no gradient wanted
    weights = torch.randn(3, generator=torch.Generator().manual_seed(0))
    (dx,) = gradients((x * x * y,), [x, y])
    torch.testing.assert_close(dx, 2 * x.detach() * y * weights)
    assert main(["--grad", "--ops", "softmax,addr", "--max-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "OpInfo sweep (float32, gradients," in out and "failing ops" not in out
    assert "samples: 6  passed: 6" in out  # softmax, softmax.with_dtype, addr
    with pytest.raises(SystemExit):
        main(["--grad", "--dtype", "int32", "--ops", "cumsum"])


def test_the_sweep_takes_reference_and_non_contiguous_inputs(capsys):
    """``--inputs noncontiguous``: the samples' values in strided storage;
    ``--inputs reference``: OpInfo's reference inputs past its samples."""
    add = OPS["add"]
    samples = samples_of(add, 4)
    strided = samples_of(add, 4, inputs="noncontiguous")
    assert len(strided) == len(samples) == 4
    for plain, other in zip(samples, strided):
        torch.testing.assert_close(other.input, plain.input)
        if other.input.numel() > 1:
            assert not other.input.is_contiguous()
    every = list(add.sample_inputs("cpu", torch.float32))
    extra = samples_of(add, None, inputs="reference")
    assert extra and len(extra) + len(every) == len(
        list(add.reference_inputs("cpu", torch.float32))
    )
    assert samples_of(OPS["sum"], None, inputs="reference") == []  # none defined
    assert main(["--inputs", "noncontiguous", "--ops", "add,transpose", "--max-samples", "3"]) == 0
    out = capsys.readouterr().out
    assert "(float32, non-contiguous samples, CPU," in out and "failing ops" not in out
    assert "samples: 6  passed: 6" in out


@pytest.mark.parametrize("name", ["select", "slice", "as_strided", "broadcast_shapes"])
def test_generic_samples_compared_from_graph_replays(name):
    """``--generic --cudagraphs``: every sample of an op whose outputs are
    views of its inputs or sizes, compiled together and called three times
    (the warm-up, the capture, a replay).  AOTAutograd makes a view of an
    input again from the caller's input with the output's layout, so a copy
    out of the graph (storage offset 0) made the wrong view, whether the
    plan made the view or an ATen fallback did (``as_strided``); a bucket
    graph returned the bucket's size for every call's."""
    import tests.opinfo_sweep as sweep

    sweep.OPTIONS["cudagraphs"] = True
    try:
        result = sweep_op(OPS[name], 8, generic=True)
    finally:
        sweep.OPTIONS.clear()
    assert result.samples > 0
    assert not result.failures, "\n".join(result.failures)


def test_a_sample_dynamo_fails_on_is_named_so():
    """``max_pool2d_with_indices_backward``'s samples pass a bare int kernel
    size, which Dynamo (torch 2.13, any backend) makes a SymInt under
    ``dynamic=True`` and then fails on in fake tensors.  Such a failure is
    reported as Dynamo's, found by running the sample with the ``eager``
    backend; none may be tilec's."""
    result = sweep_op(OPS["max_pool2d_with_indices_backward"], 2, generic=True)
    assert result.samples == 2
    assert all("fails before tilec (Dynamo" in f for f in result.failures), result.failures
