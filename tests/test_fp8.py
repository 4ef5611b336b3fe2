"""fp8 linear layers (``passes/fp8.py``): e4m3 weights and activations.

The Triton interpreter's fp8 casts round wrongly (FACTS.md), so fp8 GEMMs
are checked against the reference interpreter (which rounds with torch) and
compiled for sm_90, where ``tl.dot`` takes e4m3 tiles.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.sm90 import compile_kernel
from tests.lowering import lower_with_constants, optimize
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.interpret import interpret
from tilec.options import Options
from tilec.passes.fp8 import E4M3, E4M3_MAX, fp8_linear, quantize_weight
from tilec.passes.quantize import quantize
from tilec.target import H100_SXM


def _linear_graph(x, w, b):
    """A linear layer whose weight and bias are constants (as freezing makes them)."""
    graph = lower_with_constants(lambda w, b, x: F.linear(x, w, b), (w, b), x)
    (node,) = [n for n in graph.nodes.values() if n.kind == "extern"]
    return graph, node, next(c for c, t in graph.constants.items() if t.shape == w.shape)


def _reference(x, w, b):
    """What the fp8 layer computes, from the same roundings, in float64."""
    w_q, w_scale = quantize_weight(w)
    xf = x.to(torch.float32)
    x_scale = xf.abs().amax(1).clamp_min(1e-12) / E4M3_MAX
    x_q = (xf / x_scale[:, None]).to(E4M3)
    acc = x_q.double() @ w_q.double().t()
    return (acc * x_scale[:, None].double() * w_scale.double() + b.double()).to(x.dtype)


def test_weight_quantization_round_trips_within_e4m3_precision():
    w = torch.randn(64, 96) * torch.logspace(-3, 2, 64)[:, None]
    w_q, scale = quantize_weight(w)
    assert w_q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert w_q.float().abs().amax(1).allclose(torch.full((64,), E4M3_MAX))
    back = w_q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: relative error at most 2**-4 per element.
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale[:, None] * 2**-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_ir_matches_its_reference(dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 40).to(dtype), torch.randn(24, 40), torch.randn(24).to(dtype)
    w = w.to(dtype)
    graph, node, weight = _linear_graph(x, w, b)
    quantized = optimize(fp8_linear(graph, node, weight), gpu=True)
    (out,) = interpret(quantized, [x])
    expected = _reference(x, w, b)
    torch.testing.assert_close(
        out,
        expected,
        atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
    )
    # Against the float layer: e4m3's precision, stated loosely.
    error = (out.float() - F.linear(x, w, b).float()).norm() / F.linear(x, w, b).float().norm()
    assert error < 0.08
    # The float weight is gone; the e4m3 weight is one byte per element.
    assert weight not in quantized.constants
    assert sum(t.nbytes for t in quantized.constants.values()) < w.numel() + 2 * 4 * 24 + 64


@pytest.mark.parametrize(
    "rows, k",
    [(64, 256), (64, 200), (8192, 256)],  # K a multiple of the tiles, and ragged
)
def test_fp8_gemm_compiles_for_sm90_with_e4m3_dot(rows, k):
    """A GEMM of e4m3 tiles with both scales and the bias in its epilogue.
    With few rows its prologue computes the activations' scales (a row max)
    and their e4m3 values in registers: one kernel.  With many, each column
    tile would read the rows again (priced above a kernel of its own), so
    a row kernel computes the scales and writes the e4m3 activations (a
    byte each: less to read than the bf16 ones) for the GEMM to read."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    x, w, b = torch.randn(rows, k).to(dtype), torch.randn(512, k).to(dtype), torch.randn(512)
    graph, node, weight = _linear_graph(x, w, b.to(dtype))
    quantized = optimize(fp8_linear(graph, node, weight), Options(), gpu=True)
    kernels = [write_kernel(quantized, g, H100_SXM) for g in quantized.groups]
    (gemm,) = [k for k in kernels if k.template == "gemm"]
    e4m3_args = [a.dtype for a in gemm.args if not a.is_output].count(E4M3)
    if rows <= 64:
        assert len(kernels) == 1 and "tl.reduce(racc" in gemm.source
        assert ".to(tl.float8e4nv)" in gemm.source and e4m3_args == 1  # the weight
    else:
        assert sorted(k.template for k in kernels) == ["gemm", "persistent"]
        (row_kernel,) = [k for k in kernels if k.template != "gemm"]
        assert ".to(tl.float8e4nv)" in row_kernel.source and e4m3_args == 2
    for kernel in kernels:
        result = compile_kernel(kernel_entry(quantized, kernel.group, kernel))
        assert result["ok"], result.get("error")
        assert not result.get("spill_bytes")


def test_quantize_pass_fp8_rewrites_every_linear_layer():
    """``quantize="fp8"``: each linear layer of an MLP (the head too, with
    ``head=True``) becomes an e4m3 GEMM; the IR computes what the layer-by-layer
    fp8 reference computes, and the log reports bytes and the weight's error."""
    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(48, 32), torch.randn(48), torch.randn(16, 48), torch.randn(16)
    x = torch.randn(6, 32)

    def mlp(w1, b1, w2, b2, x):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    graph = lower_with_constants(mlp, (w1, b1, w2, b2), x)
    quantized, counts = quantize(graph, "fp8", head=True)
    assert counts["quantized"] == 2 and counts["skipped"] == 0
    assert counts["constant_bytes_after"] < counts["constant_bytes_before"] / 3
    (out,) = interpret(optimize(quantized, gpu=True), [x])
    expected = _reference(F.gelu(_reference(x, w1, b1)), w2, b2)
    error = (out - expected).norm() / expected.norm()
    assert error < 1e-3, error  # one e4m3 rounding may flip on a float32 difference
    log = "\n".join(d.text() for d in quantized.decisions)
    assert "quantized w1 f32[48, 32]: 6144 -> 1728 bytes, output error (weight rounding)" in log
    # By default the head (no matmul after it) stays float.
    _, counts = quantize(graph, "fp8")
    assert counts["quantized"] == 1 and counts["skipped"] == 1


def test_quantize_pass_fp8_leaves_batched_products_float():
    def batched(w, x):
        return torch.bmm(x, w.expand(2, -1, -1).transpose(1, 2)) + 1

    graph = lower_with_constants(batched, (torch.randn(8, 16),), torch.randn(2, 4, 16))
    quantized, counts = quantize(graph, "fp8", head=True)
    assert counts == {**counts, "quantized": 0, "skipped": 1}
    (decision,) = quantized.decisions
    assert decision.reason == "fp8_not_2d" and "fp8: only mm and addmm" in decision.detail


@pytest.mark.gpu
def test_fp8_linear_on_an_fp8_gpu():
    """A frozen bf16 MLP with ``quantize="fp8"`` on CUDA (compute capability
    8.9+): the program computes what the fp8 reference computes."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9 or newer")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)
    )
    model = model.to("cuda", torch.bfloat16).eval()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    options = {"freeze": True, "quantize": "fp8", "quantize_head": True}
    with torch.no_grad():
        out = torch.compile(model, backend="tilec", options=options)(x)
        (first, _, second) = model
        hidden = F.gelu(_reference(x, first.weight, first.bias))
        expected = _reference(hidden, second.weight, second.bias)
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error < 2e-2, error
