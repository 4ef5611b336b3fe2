"""``matmul="auto"`` on a GPU target: the template where the cost model
predicts that what fuses into it saves more than its slower tiles lose."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks import static
from benchmarks.zoo import MODELS
from tests.lowering import gpu_kernels
from tilec import cost
from tilec.decisions import Decision, of_stage
from tilec.ir import Graph, Group
from tilec.options import Options
from tilec.passes.matmul_gain import fused_gain
from tilec.target import H100_SXM, TEMPLATE_FP32


def _matmuls(graph: Graph) -> list[Decision]:
    return of_stage(graph.decisions, "matmul")


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16)


def _mlp(x, w1, b1, w2):
    return F.gelu(x @ w1 + b1) @ w2


def _decisions(rows: int, width: int) -> list[Decision]:
    x, w1, b1, w2 = _bf16(rows, width), _bf16(width, width), _bf16(width), _bf16(width, 16)
    ((graph, _), *_) = gpu_kernels(_mlp, x, w1, b1, w2)
    return _matmuls(graph)


def test_an_epilogue_that_saves_more_than_the_template_loses_takes_the_template():
    """A decode-sized up projection (8 rows): memory- and launch-bound, so
    storing GELU's output from the accumulator instead of writing the product
    and reading it back in a kernel of its own wins."""
    up, down = _decisions(8, 1024)
    assert (up.outcome, up.reason) == ("template", "epilogue")
    times = dict(up.predicted_s)
    assert times["template"] < times["library"]
    assert (down.outcome, down.reason) == ("library", "nothing_to_fuse")


def test_an_epilogue_that_saves_less_than_the_template_loses_stays_in_the_library():
    """A large, compute-bound projection: the template's predicted loss
    (0.85 of the library's rate over 4096 x 4096 x 4096) is larger than
    the product's write and read that fusing GELU saves."""
    up, _ = _decisions(4096, 4096)
    assert (up.outcome, up.reason) == ("library", "library_faster")
    times = dict(up.predicted_s)
    assert times["library"] < times["template"]
    assert "predicted" in up.text() and "us" in up.text()


def test_scores_a_softmax_reads_stay_a_library_call():
    """``softmax(q @ k / c)``: the softmax kernel computes the scaled scores
    from the product itself, so an epilogue saves nothing (unet_block's
    attention, which the template priced as free before).  The
    probabilities are returned too, so this is not rewritten into one
    attention (``passes/attention.py``)."""

    def attention(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1)
        return p @ v, p

    q, k, v = _bf16(2, 256, 64), _bf16(2, 256, 64), _bf16(2, 256, 64)
    ((graph, _), *_) = gpu_kernels(attention, q, k, v)
    scores, out = _matmuls(graph)
    assert (scores.outcome, scores.reason) == ("library", "nothing_to_fuse")
    assert {what for what, _ in scores.predicted_s} == {"library", "template"}
    assert out.outcome == "library"


def test_unet_blocks_attention_is_one_kernel_and_its_linear_a_library_call():
    """unet_block's attention (``v @ softmax(q @ k / c)^T``) becomes one
    attention kernel (``passes/attention.py``); the matmul left, a linear
    layer with nothing to fuse, stays in the library."""
    spec = MODELS["unet_block"]
    model = spec.build("tiny").model.eval().to(torch.bfloat16)
    inputs = tuple(
        t.to(torch.bfloat16) if t.is_floating_point() else t
        for t in spec.inputs("tiny", 1, torch.Generator().manual_seed(0))
    )
    captured = static.tilec_graphs(model, inputs)
    assert [k.template for c in captured for k in c.kernels].count("attention") == 1
    decisions = [d for c in captured for d in _matmuls(c.graph)]
    plain = [d for d in decisions if d.reason == "nothing_to_fuse" and d.predicted_s]
    assert plain, [d.text() for d in decisions]
    assert all(d.outcome == "library" for d in decisions if d.reason == "nothing_to_fuse")


def test_a_dequantized_weight_takes_the_template_when_it_pays():
    """int8 weights dequantized in the prologue: the template reads a byte
    per weight instead of a kernel writing bf16 weights for the library."""

    def linear(x, w_q, scale):
        return x @ (w_q.to(torch.bfloat16) * scale).t()

    x = _bf16(4, 2048)
    w_q = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    scale = _bf16(2048, 1)
    ((graph, _), *_) = gpu_kernels(linear, x, w_q, scale)
    (decision,) = _matmuls(graph)
    assert (decision.outcome, decision.reason) == ("template", "prologue")
    times = dict(decision.predicted_s)
    assert times["template"] < times["library"]


@pytest.mark.parametrize("images", [1, 2])
def test_a_template_reading_its_product_through_an_nhwc_view_takes_the_epilogue(images):
    """ConvNeXt's MLP on an NHWC map: the product of (56 * 56, C) rows is read
    as (1, 56, 56, C), at ``Mod(floor(i0 / 56), 56)``, which is
    ``floor(i0 / 56)`` while ``i0 < 3136`` (``ix._factor_bounds``); of two
    images, at ``3136 * floor(i0 / 3136) + 56 * Mod(floor(i0 / 56), 56) +
    Mod(i0, 56)``, which is ``i0`` (``ix._recombine_divmod``): fusion sees
    the position as the product's own, so GELU goes into the GEMM's kernel
    and the template stays (it went back to the library, with nothing
    fused, until index bounds looked into floors, and at two images until
    a split over three levels was put back together)."""

    def block(x, w1, b1, w2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2)

    x, w1, b1, w2 = _bf16(images, 56, 56, 96), _bf16(384, 96), _bf16(384), _bf16(96, 384)
    ((graph, _), *_) = gpu_kernels(block, x, w1, b1, w2)
    up = _matmuls(graph)[0]
    assert (up.outcome, up.reason) == ("template", "epilogue"), up.text()
    call = up.subject.lstrip("%")
    (group,) = [g for g in graph.groups if call in g.nodes]
    kinds = {graph.nodes[n].kind for n in group.nodes if n != call}
    assert "pointwise" in kinds, kinds


def _fused_template(rows: int, width: int) -> tuple[Graph, Group, str]:
    """The up projection of ``_mlp`` forced into the template and fused:
    (graph, its kernel's group, the call's node name)."""
    x, w1, b1, w2 = _bf16(rows, width), _bf16(width, width), _bf16(width), _bf16(width, 16)
    ((graph, _), *_) = gpu_kernels(_mlp, x, w1, b1, w2, options=Options(matmul="triton"))
    up = _matmuls(graph)[0].subject.lstrip("%")
    (group,) = [g for g in graph.groups if up in g.nodes]
    return graph, group, up


def test_a_fused_template_is_priced_against_the_library_path():
    """After fusion, the template's kernel as fused (GELU stored from the
    accumulator) against the library call plus a kernel reading the product
    back: the template wins when memory-bound (8 rows), the library when
    compute-bound (4096 rows); the same verdicts as before fusion."""
    graph, group, up = _fused_template(8, 1024)
    assert any(graph.nodes[n].kind == "pointwise" and n != up for n in group.nodes)
    faster, times = fused_gain(graph, group, up, H100_SXM)
    assert faster and dict(times)["template"] < dict(times)["library"]
    graph, group, up = _fused_template(4096, 4096)
    faster, times = fused_gain(graph, group, up, H100_SXM)
    assert not faster and dict(times)["library"] < dict(times)["template"]


def test_the_library_path_pays_for_the_epilogue_kernel_it_needs():
    """The library side of the fused pricing is the library call and one
    kernel that reads the product and the bias and writes what the
    template's kernel stores: its bytes worked out here."""
    graph, group, up = _fused_template(8, 1024)
    library = dict(fused_gain(graph, group, up, H100_SXM)[1])["library"]
    call = cost.gemm(
        H100_SXM,
        2 * 8 * 1024 * 1024,
        2 * (8 * 1024 + 1024 * 1024 + 8 * 1024),
        torch.bfloat16,
        template=False,
    ).seconds
    # The epilogue kernel: the product read back, the bias read, GELU's
    # output (bf16, 8 x 1024) written.
    epilogue = cost.kernel(H100_SXM, 2 * 8 * 1024 + 2 * 1024 + 2 * 8 * 1024).seconds
    assert library == pytest.approx(call + epilogue, rel=1e-9)


def test_an_fp32_epilogue_stays_in_the_library_at_the_measured_fp32_template_rate():
    """The fp32 template (Triton's FMA dot, no TF32) measured about 5.7
    TFLOP/s on an H200 (``target.TEMPLATE_FP32``), a tenth of the library's
    fp32 rate: the decode-sized projection whose bf16 version takes the
    template (the first test) stays a library call in fp32."""
    assert dict(H100_SXM.template_flops)["fp32"] is TEMPLATE_FP32
    x, w1, b1, w2 = (torch.randn(*s) for s in ((8, 1024), (1024, 1024), (1024,), (1024, 16)))
    ((graph, _), *_) = gpu_kernels(_mlp, x, w1, b1, w2)
    up, _ = _matmuls(graph)
    assert (up.outcome, up.reason) == ("library", "library_faster"), up.text()
