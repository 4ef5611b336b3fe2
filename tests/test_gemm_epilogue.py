"""A GEMM template's tile leaves its epilogue registers (``gemm.fit_epilogue``):
the values an element of the output tile holds at once in the epilogue
(``gemm.epilogue_values``) narrow a 128 x 128 tile whose epilogue would
spill on sm_90, as training's dropout and GELU-backward epilogues did
(``train-full-b8-bf16``: up to 7.8 KB a thread)."""

from __future__ import annotations

import pytest
import torch

from tests.lowering import lower_with_constants, optimize
from tilec.gemm import (
    DOT,
    GemmConfig,
    epilogue_values,
    fit_epilogue,
    gemm_config,
    template_config,
)
from tilec.options import Options
from tilec.target import H100_SXM, INTERPRETER

OPTIONS = Options.from_user(None, {"freeze": True, "matmul": "triton"})


def _bias(w, b, x):
    return x @ w.t() + b


def _erfc(w, b, x):
    return torch.erfc(x @ w.t() + b)


def _gelu_backward(w, x, pre):
    return torch.ops.aten.gelu_backward(x @ w.t(), pre, approximate="tanh")


def _template(fn, constants, *inputs):
    graph = optimize(lower_with_constants(fn, constants, *inputs), OPTIONS, gpu=True)
    (group,) = [g for g in graph.groups if any(graph.nodes[n].reduce_op == DOT for n in g.nodes)]
    (dot,) = [graph.nodes[n] for n in group.nodes if graph.nodes[n].reduce_op == DOT]
    return graph, group, dot


def _inputs(m=1024, n=768, k=768):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    pre = torch.randn(m, n, generator=g).to(torch.bfloat16)
    return w, b, x, pre


def _values(graph, group, dot):
    return epilogue_values(graph, group.nodes, group.stored, dot)


def test_epilogue_values_count_what_an_element_holds_at_once():
    w, b, x, pre = _inputs()
    # acc + b: the accumulator and the sum (the bias is one per column).
    assert _values(*_template(_bias, (w, b), x)) == 2
    # GELU's backward (tanh form) from the accumulator and the saved input:
    # the rounded product, the input, its square, tanh, and partial sums
    # are live together.
    assert _values(*_template(_gelu_backward, (w,), x, pre)) == 6


def test_a_threads_share_of_the_epilogue_narrows_the_tile():
    wide = GemmConfig(128, 128, 64, 8)  # 64 elements a thread
    assert fit_epilogue(wide, 2) == wide
    assert fit_epilogue(wide, 3) == wide  # inference's GELU
    assert fit_epilogue(wide, 5) == wide  # GELU's backward, erf form: 125 registers
    assert fit_epilogue(wide, 6) == GemmConfig(128, 64, 64, 8)  # 32 elements a thread
    assert fit_epilogue(wide, 12) == GemmConfig(64, 64, 64, 8)
    assert fit_epilogue(wide, 100) == GemmConfig(64, 64, 64, 8)  # no narrower than 64 x 64
    assert fit_epilogue(GemmConfig(16, 64, 512, 4), 100) == GemmConfig(16, 64, 512, 4)
    # The heuristic's tiles with no epilogue to fit are as before.
    assert gemm_config(H100_SXM, 1024, 768, 768, torch.bfloat16).block_n == 128


def test_a_heavy_epilogue_takes_a_narrower_tile_on_a_gpu_only():
    w, b, x, pre = _inputs()
    heavy = _template(_gelu_backward, (w,), x, pre)
    assert template_config(*heavy, H100_SXM).config.block_n == 64
    assert template_config(*_template(_bias, (w, b), x), H100_SXM).config.block_n == 128
    # erfc's slow path holds four values more while it computes: at 128 x
    # 128 it spilled 296 bytes a thread on sm_90.
    erfc = _template(_erfc, (w, b), x)
    assert _values(*erfc) == 2 + 4
    assert template_config(*erfc, H100_SXM).config.block_n == 64
    # The interpreter has no registers to fit: its tiles are the same.
    interpreted = gemm_config(INTERPRETER, 1024, 768, 768, torch.bfloat16)
    assert gemm_config(INTERPRETER, 1024, 768, 768, torch.bfloat16, epilogue=6) == interpreted


@pytest.mark.slow
def test_the_narrowed_epilogue_compiles_without_a_spill_on_sm90(tmp_path, monkeypatch):
    """The GELU-backward template as codegen writes it compiles for sm_90
    without a spill, and so does its source at 128 x 128, since tanh takes
    no log (``_tanh``): with Kahan's expm1 it spilled 816 bytes there
    (triton 3.7.1)."""
    from benchmarks.sm90 import compile_kernel
    from tilec.codegen.kernel import write_kernel
    from tilec.codegen.record import kernel_entry

    # A fresh cache: a cached kernel skips ptxas and its register report.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    w, _, x, pre = _inputs()
    graph, group, dot = _template(_gelu_backward, (w,), x, pre)
    entry = kernel_entry(graph, group, write_kernel(graph, group, H100_SXM))
    assert entry["constexprs"]["BLOCK_N"] == 64
    for block_n in (64, 128):
        constexprs = entry["constexprs"] | {"BLOCK_N": block_n}
        compiled = compile_kernel(entry | {"constexprs": constexprs})
        assert compiled["ok"], compiled.get("error")
        assert "registers" in compiled and not compiled.get("spill_bytes"), (block_n, compiled)


def test_the_generic_variant_narrows_alike():
    """Rows of symbolic length (the generic variant; 1024 the hint): the
    epilogue is counted over the same tile, so the kernel takes the same
    narrower tile as the static one."""
    from tests.lowering import gpu_kernels

    w, _, x, pre = _inputs()

    def gelu_backward(x, pre, w):
        return _gelu_backward(w, x, pre)

    for generic in (False, True):
        dynamic = ((0,), (0,), ()) if generic else None
        kernels = gpu_kernels(
            gelu_backward, x, pre, w, generic=generic, options=OPTIONS, dynamic=dynamic
        )
        (kernel,) = [k for _, k in kernels if k.template == "gemm"]
        assert bool(kernel.sizes) == generic
        assert kernel.launch.constexprs["BLOCK_N"] == 64
