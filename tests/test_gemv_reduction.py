"""The option ``gemv_reduction`` (``passes/matmul.py``): products of one
row that would take the GEMM template are written as sum reductions.
Checked against a float64 reference of the weights the program computes,
and the sm_90 kernels of TinyLlama's decode GEMVs compiled on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.sm90 import compile_kernel
from benchmarks.static import kernel_prediction
from tests.lowering import lower_with_constants, optimize
from tests.test_quantize import _compile, _program_weights, _with_weights
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.decisions import Reason, of_stage
from tilec.interpret import interpret
from tilec.options import Options
from tilec.passes.matmul import _library_faster
from tilec.passes.quantize import quantize
from tilec.target import H100_SXM


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 384), nn.SiLU(), nn.Linear(384, 128)).eval()


# Each weight scheme's options, float32 first (under the interpreter auto
# keeps a float32 product in the library: ``triton`` takes the template).
WEIGHTS = pytest.mark.parametrize(
    "options",
    [
        {"matmul": "triton"},
        {"quantize": "int8_weight_only", "quantize_head": True},
        {"quantize": "int4_weight_only", "quantize_head": True},
    ],
    ids=["float32", "int8", "int4"],
)


@WEIGHTS
def test_one_row_products_are_sum_reductions(options: dict) -> None:
    """Each product of one row is a sum reduction, in no kernel a ``tl.dot``,
    and the output is the model's with the weights the program computes
    (its dequantized ones), in float64, within float32's accumulation."""
    model, x = _model(), torch.randn(1, 256)
    out, graph = _compile(model, x, gemv_reduction=True, **options)
    matmuls = of_stage(graph.decisions, "matmul")
    assert [d.outcome for d in matmuls] == ["reduction", "reduction"]
    assert all(d.reason == "gemv_reduction" for d in matmuls)
    assert not any(n.reduce_op == "dot" for n in graph.nodes.values())
    quantized = "quantize" in options
    weights = _program_weights(graph) if quantized else {}
    assert sorted(weights) == (["0.weight", "2.weight"] if quantized else [])
    reference = _with_weights(model, weights).double()
    with torch.no_grad():
        expected = reference(x.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", [None, "int4_weight_only"])
def test_bf16_products_without_a_bf16_dot_are_reductions(scheme: str | None) -> None:
    """Under the interpreter (no bf16 dot) bf16 products would stay library
    calls; with the option those of one row are reductions too, rounded
    once to bf16 at the end as the library's."""
    model, x = _model().bfloat16(), torch.randn(1, 256).bfloat16()
    options = {"quantize": scheme, "quantize_head": True} if scheme else {}
    out, graph = _compile(model, x, gemv_reduction=True, **options)
    assert [d.outcome for d in of_stage(graph.decisions, "matmul")] == ["reduction"] * 2
    weights = _program_weights(graph) if scheme else {}
    assert sorted(weights) == (["0.weight", "2.weight"] if scheme else [])
    reference = _with_weights(model, weights).double()
    with torch.no_grad():
        expected = reference(x.double())
    # The output's bf16 rounding (2**-8 relative) and the hidden layer's.
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_more_rows_or_without_the_option_keep_the_template() -> None:
    """Two rows keep the template with the option (each output row would
    read the weight again); one row keeps it without."""
    model = _model()
    options = {"quantize": "int8_weight_only", "quantize_head": True}
    for rows, on in ((2, True), (1, False)):
        _, graph = _compile(model, torch.randn(rows, 256), gemv_reduction=on, **options)
        assert {d.outcome for d in of_stage(graph.decisions, "matmul")} == {"template"}


def test_option_is_a_bool() -> None:
    with pytest.raises(TypeError, match="gemv_reduction"):
        Options.from_user(None, {"gemv_reduction": 1})


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int4_weight_only"])
def test_decode_gemv_reduction_compiles_for_sm90(scheme: str) -> None:
    """TinyLlama's o projection at one row (2048 x 2048), as a reduction: one
    kernel reading the packed weight and the input once each (its bytes are
    the template's), priced by the decision as the static report prices
    it, and on sm_90 no spill and no load of one byte."""

    def linear(w, x):
        return nn.functional.linear(x, w)

    w, x = torch.randn(2048, 2048).bfloat16(), torch.randn(1, 2048).bfloat16()
    graph, _ = quantize(lower_with_constants(linear, (w,), x), scheme, 128, head=True)
    kernels = {}
    for on in (True, False):
        optimized = optimize(graph, Options(gemv_reduction=on), gpu=True)
        (group,) = optimized.groups
        kernels[on] = optimized, group, write_kernel(optimized, group, H100_SXM)
    (optimized, group, reduction), (_, _, template) = kernels[True], kernels[False]
    assert "tl.dot" not in reduction.source and "tl.dot" in template.source
    assert reduction.reads == template.reads
    assert reduction.bytes_written == template.bytes_written
    # The decision prices the kernel as the static report does.
    (decision,) = of_stage(optimized.decisions, "matmul")
    priced = dict(decision.predicted_s)["reduction"]
    assert priced == pytest.approx(kernel_prediction(reduction).seconds)
    # int4: the sum walks the packed bytes (two products a step), so each
    # byte is loaded once, not one byte per lane by two lanes.
    (red,) = [n for n in optimized.nodes.values() if n.kind == "reduction"]
    assert red.reduce_shape == ((1024,) if scheme == "int4_weight_only" else (2048,))
    result = compile_kernel(kernel_entry(optimized, group, reduction))
    assert result["ok"], result.get("error")
    assert not result.get("spill_bytes") and result["loads_8"] == 0


def test_a_one_row_product_the_library_keeps_is_a_reduction_where_faster() -> None:
    """A bf16 one-row product with nothing to fuse stays a library call on
    the H100 without the option; with it, it is priced as a sum reduction
    as well and takes it, predicted faster (a full-bandwidth stream against
    the library's few-row share), and the program (run by the IR
    interpreter) gives the product within bf16's rounding; its kernel
    compiles for sm_90 without a spill."""

    def linear(w, x):
        return nn.functional.linear(x, w)

    w, x = torch.randn(384, 256).bfloat16(), torch.randn(1, 256).bfloat16()
    graph = lower_with_constants(linear, (w,), x)
    decisions = {}
    for on in (False, True):
        optimized = optimize(graph, Options(gemv_reduction=on), gpu=True)
        (decisions[on],) = of_stage(optimized.decisions, "matmul")
    assert (decisions[False].outcome, decisions[False].reason) == ("library", "nothing_to_fuse")
    assert decisions[True].outcome == "reduction"
    assert "nothing to fuse" in decisions[True].detail
    times = dict(decisions[True].predicted_s)
    assert 0 < times["reduction"] < times["library"]
    assert sum(n.reduce_op == "sum" for n in optimized.nodes.values()) == 1
    (out,) = interpret(optimized, [x])
    expected = nn.functional.linear(x.double(), w.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    (group,) = optimized.groups
    kernel = write_kernel(optimized, group, H100_SXM)
    assert "tl.dot" not in kernel.source
    result = compile_kernel(kernel_entry(optimized, group, kernel))
    assert result["ok"], result.get("error")
    assert not result.get("spill_bytes")


def test_a_library_product_stays_where_its_reduction_is_not_faster() -> None:
    """The choice between the library and the reduction (``_library_faster``):
    only a product the cost model left in the library is weighed, and it
    stays there where its reduction is unpriced or no faster."""
    library = {"library": 2e-6}
    kept = (False, Reason("nothing_to_fuse", "auto"), tuple(library.items()))
    assert not _library_faster(kept, 1e-6)
    assert _library_faster(kept, 2e-6) and _library_faster(kept, None)
    # Not the cost model's choice: an option, or what the template cannot compute.
    forced = (False, Reason("option_library", 'option matmul="library"'), ())
    assert not _library_faster(forced, None)
    assert not _library_faster((True, Reason("epilogue", "auto"), ()), None)
