"""Random numbers in kernels (``compiler/rng.py``): dropout in training,
without a fallback.

Oracles: Triton's own ``tl.rand`` (values it gave, below), the IR
interpreter (``rng.uniform``, which must give the kernels' bits), eager's
semantics (the kept elements scaled by ``1 / (1 - p)``, the gradient
through the same mask) and the binomial law of the kept fraction.  Bit
equality with eager's masks is not expected: eager's generators draw
differently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilec
from benchmarks.sm90 import compile_kernel
from benchmarks.zoo import MODELS
from tests.lowering import gpu_kernels
from tilec import rng
from tilec.codegen.record import kernel_entry

# tl.rand(2**31 - 2, offset) in Triton's interpreter (triton 3.7.1).
TRITON_RAND = {
    0: 0.441071093082428,
    1: 0.21371276676654816,
    2: 0.37638965249061584,
    12345: 0.827450692653656,
    2**31 - 1: 0.8932251930236816,
    2**33 + 7: 0.8311215043067932,
}


def test_uniform_is_tritons_rand_bit_for_bit():
    offsets = torch.tensor(list(TRITON_RAND), dtype=torch.int64)
    got = rng.uniform(torch.tensor(2**31 - 2), offsets)
    assert got.dtype == torch.float32
    assert got.tolist() == [torch.tensor(v).item() for v in TRITON_RAND.values()]


def _dropout(x, p=0.3):
    return F.dropout(x, p, training=True) * 2


@pytest.mark.parametrize("interpret", [False, True], ids=["kernels", "ir-interpreter"])
def test_dropout_keeps_one_minus_p_and_scales(interpret):
    x = torch.randn(64, 100) + 3  # no element is 0
    tilec.reset_stats()
    torch.manual_seed(0)
    out = torch.compile(_dropout, backend="tilec", options={"interpret": interpret})(x)
    assert tilec.stats()["fallbacks"] == {}
    kept = out != 0
    # 6400 draws of probability 0.7: 4480 expected, sd 37.
    assert abs(int(kept.sum()) - 4480) < 4 * 37
    torch.testing.assert_close(out[kept], (x * 2 / 0.7)[kept])


def test_kernels_and_the_interpreter_draw_the_same_mask():
    x = torch.randn(33, 70)
    results = []
    for interpret in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(7)
        results.append(
            torch.compile(_dropout, backend="tilec", options={"interpret": interpret})(x)
        )
    assert torch.equal(results[0] != 0, results[1] != 0)


def test_seeded_runs_repeat_and_calls_differ():
    x = torch.randn(40, 50) + 3
    compiled = torch.compile(_dropout, backend="tilec")
    torch.manual_seed(3)
    first, second = compiled(x), compiled(x)
    torch.manual_seed(3)
    again = compiled(x)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_two_dropouts_in_a_graph_draw_different_masks():
    x = torch.randn(50, 60) + 3
    a, b = torch.compile(lambda x: (F.dropout(x, 0.5), F.dropout(x, 0.5)), backend="tilec")(x)
    assert not torch.equal(a != 0, b != 0)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_of_none_or_all(p):
    x = torch.randn(8, 9) + 3
    out = torch.compile(lambda x: F.dropout(x, p, training=True), backend="tilec")(x)
    torch.testing.assert_close(out, x if p == 0 else torch.zeros_like(x))


def test_the_gradient_goes_through_the_same_mask():
    x = torch.randn(32, 48, requires_grad=True)
    tilec.reset_stats()
    out = torch.compile(lambda x: F.dropout(x, 0.4).sin(), backend="tilec")(x)
    out.sum().backward()
    assert tilec.stats()["fallbacks"] == {}
    kept = out != 0
    scale = 1 / 0.6
    expected = torch.where(kept, torch.cos(x.detach() * scale) * scale, torch.zeros(()))
    torch.testing.assert_close(x.grad, expected)


def test_gpt2_training_step_with_dropout_falls_back_on_nothing():
    spec = MODELS["gpt2"]
    model = spec.build("tiny").model.train()  # dropout on
    inputs = spec.inputs("tiny", 2, torch.Generator().manual_seed(0))
    tilec.reset_stats()
    torch.compile(model, backend="tilec")(*inputs).square().mean().backward()
    assert tilec.stats()["fallbacks"] == {}
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _native_dropout(x, p=0.3):
    """What AOTAutograd traces for ``_dropout`` (the test helper's own
    tracing, without grad, decomposes it to an ATen ``bernoulli_``)."""
    return torch.ops.aten.native_dropout(x, p, True)[0] * 2


def test_a_dropout_kernel_compiles_for_sm90():
    # A module defines _rand only where a kernel calls it (prelude_for).
    kernels = [
        (g, k)
        for g, k in gpu_kernels(_native_dropout, torch.randn(64, 100))
        if "_rand(" in k.source
    ]
    assert kernels
    for graph, kernel in kernels:
        result = compile_kernel(kernel_entry(graph, kernel.group, kernel))
        assert result["ok"], result.get("error")
        assert not result.get("spill_bytes")
