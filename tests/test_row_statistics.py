"""Row statistics in reduction kernels (``passes/fuse.py``,
``statistics_space``; ``inline.row_statistics``): a reduction over fewer
rows than the kernel's (an RMS norm's mean square) is computed inside the
kernel of the reduction that reads it, from the loads that reduction makes.
A decode step's norms thus share the kernels of the GEMVs after them
(option ``gemv_reduction``).  Checked against eager torch, or a float64
reference of the weights the program computes; the sm_90 kernel of
TinyLlama's normed q/k/v product compiled on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import tilec
from benchmarks.sm90 import compile_kernel
from tests.lowering import lower_with_constants, new_programs, optimize
from tests.test_gemv_reduction import WEIGHTS
from tests.test_quantize import _compile, _program_weights, _with_weights
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.decisions import of_stage
from tilec.ir import Graph, Group
from tilec.options import Options
from tilec.passes.quantize import quantize
from tilec.target import H100_SXM


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LLaMA's RMS norm: the mean square in float32, the normed row cast back."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


class _NormLinear(nn.Module):
    """An RMS norm, then a linear layer: a decode step's norm and q/k/v."""

    def __init__(self, k: int = 256, n: int = 384):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(k))
        self.proj = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(_rms_norm(x, self.weight))


def _reduction_groups(graph: Graph) -> list[Group]:
    return [g for g in graph.groups if any(graph.nodes[n].kind == "reduction" for n in g.nodes)]


def _reductions(graph: Graph, group: Group) -> dict[str, tuple]:
    """Each reduction of ``group``: (its rows, its reduction extent)."""
    nodes = [graph.nodes[n] for n in group.nodes]
    return {n.name: (n.shape, n.reduce_shape) for n in nodes if n.kind == "reduction"}


def _assert_refused(f: Callable, inputs: tuple[torch.Tensor, ...], why: str) -> None:
    """``f`` compiled keeps its statistic in a kernel of its own: fusion
    refused it (reason ``row_statistic``, its detail saying ``why``), and
    the output is eager's."""
    before = set(tilec.programs())
    out = torch.compile(f, backend="tilec")(*inputs)
    (program,) = new_programs(before)
    graph = program.graph
    assert len(_reduction_groups(graph)) == 2
    refused = [d for d in of_stage(graph.decisions, "fuse") if d.reason == "row_statistic"]
    assert refused and all(why in d.detail for d in refused), refused
    torch.testing.assert_close(out, f(*inputs), rtol=1e-5, atol=1e-5)


@WEIGHTS
def test_a_norm_shares_the_kernel_of_the_gemv_after_it(options: dict) -> None:
    """One kernel computes the norm's mean square and the product of one
    row (int4: both walked over K / 2 steps of two positions), and the
    output is the model's with the weights the program computes, in
    float64, within float32's accumulation."""
    model, x = _NormLinear().eval(), torch.randn(1, 256)
    out, graph = _compile(model, x, gemv_reduction=True, **options)
    assert [d.outcome for d in of_stage(graph.decisions, "matmul")] == ["reduction"]
    (group,) = _reduction_groups(graph)
    extent = (128,) if "int4" in str(options.get("quantize")) else (256,)
    spaces = sorted(_reductions(graph, group).values())
    assert spaces == [((1,), extent), ((1, 384), extent)]
    weights = _program_weights(graph) if "quantize" in options else {}
    assert sorted(weights) == (["proj.weight"] if "quantize" in options else [])
    reference = _with_weights(model, weights).double()
    with torch.no_grad():
        expected = reference(x.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_bf16_norm_and_int4_gemv_under_the_interpreter() -> None:
    """bf16 activations (the norm's row cast back to bf16 before the
    product, as LLaMA's) with an int4 weight: one kernel, within bf16's
    rounding of the float64 reference."""
    model, x = _NormLinear().bfloat16().eval(), torch.randn(1, 256).bfloat16()
    options = {"quantize": "int4_weight_only", "quantize_head": True}
    out, graph = _compile(model, x, gemv_reduction=True, **options)
    (group,) = _reduction_groups(graph)
    assert len(_reductions(graph, group)) == 2
    reference = _with_weights(model, _program_weights(graph)).double()
    with torch.no_grad():
        expected = reference(x.double())
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("k", [64, 5000], ids=["persistent", "looped"])
def test_a_statistic_of_each_row_in_a_reduction_kernel(k: int) -> None:
    """Not a matmul: rows (3, 16) summing a normed row against 16 others;
    the norm's statistic has rows (3, 1), read at each row's own position.
    One kernel, with the row in registers (64) or looped (5000: the
    statistic in a loop of its own first), equal to eager."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed[:, None, :] * w[None]).sum(-1)

    torch.manual_seed(0)
    x, w = torch.randn(3, k), torch.randn(16, k)
    before = set(tilec.programs())
    out = torch.compile(f, backend="tilec")(x, w)
    (program,) = new_programs(before)
    graph = program.graph
    (group,) = _reduction_groups(graph)
    assert sorted(_reductions(graph, group).values()) == [((3,), (k,)), ((3, 16), (k,))]
    torch.testing.assert_close(out, f(x, w), rtol=1e-5, atol=1e-5)


def test_a_statistic_of_what_the_kernel_does_not_read_keeps_its_kernel() -> None:
    """The mean square of ``y`` scaling a sum over ``x``: the kernel of the
    sum does not load ``y``, so computing the statistic there would read
    ``y`` again in every program.  Refused, and named."""

    def f(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        scaled = x * y.pow(2).mean(-1, keepdim=True)
        return (scaled[:, None, :] * w[None]).sum(-1)

    torch.manual_seed(0)
    x, y, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(16, 64)
    _assert_refused(f, (x, y, w), "where the kernel does not")


@pytest.mark.parametrize("scheme", [None, "int8_weight_only", "int4_weight_only"])
def test_tinyllama_norm_and_qkv_compile_for_sm90(scheme: str | None) -> None:
    """TinyLlama's input norm and q/k/v product at one row (2048 x 2560) in
    bf16, int8 and int4: one kernel, reading each buffer's bytes once (the
    row, the norm's weight, the product's weights), and on sm_90 no spill
    and no load of one byte."""

    def layer(g: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(_rms_norm(x, g), w)

    torch.manual_seed(0)
    g, w = torch.randn(2048).bfloat16(), torch.randn(2560, 2048).bfloat16()
    x = torch.randn(1, 2048).bfloat16()
    graph = lower_with_constants(layer, (g, w), x)
    if scheme:
        graph, _ = quantize(graph, scheme, 128, head=True)
    optimized = optimize(graph, Options(gemv_reduction=True), gpu=True)
    (group,) = _reduction_groups(optimized)
    assert len(_reductions(optimized, group)) == 2
    kernel = write_kernel(optimized, group, H100_SXM)
    assert "tl.dot" not in kernel.source
    weights = sum(t.numel() * t.element_size() for t in optimized.constants.values())
    assert sum(kernel.reads.values()) == weights + 2 * 2048
    result = compile_kernel(kernel_entry(optimized, group, kernel))
    assert result["ok"], result.get("error")
    assert not result.get("spill_bytes") and result["loads_8"] == 0


def test_a_statistic_read_at_a_gathered_row_keeps_its_kernel() -> None:
    """Each row scaled by the mean square of a row chosen by an index
    tensor: the statistic's position is read from data, not a function of
    the kernel's row, so it is not computed there.  Refused, and equal to
    eager."""

    def f(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        square = x.pow(2).mean(-1)
        scaled = x * square[rows][:, None]
        return (scaled[:, None, :] * w[None]).sum(-1)

    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(16, 64)
    _assert_refused(f, (x, torch.tensor([2, 0, 1]), w), "not at one of the row's")
