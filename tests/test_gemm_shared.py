"""A GEMM template's pipeline stages fit a block's shared memory
(``gemm.fit_shared_memory``): the count of what a K step copies ahead,
against sm_90 compiles of TinyLlama's decode GEMMs at 8 rows, where a
prologue's loads took a kernel over the 227 KB an H100 block may have."""

from __future__ import annotations

import pytest
import sympy

from tilec import cost
from tilec import index as ix
from tilec.gemm import DOT, GemmConfig, _k_positions, fit_shared_memory, packing, staged_steps
from tilec.target import H100_SXM

pytest.importorskip("transformers")


def test_k_positions_count_what_a_step_reads_along_k():
    (r,) = ix.reduce_symbols(1)
    i0 = ix.out_symbols(1)[0]
    assert _k_positions((i0, r), r, 512) == 512
    assert _k_positions((sympy.floor(r / 2), i0), r, 512) == 256  # int4 bytes
    assert _k_positions((sympy.floor(r / 128), i0), r, 512) == 4  # a group's scales
    # Heads and their dimension viewed as K: every position.
    assert _k_positions((i0, sympy.floor(r / 64), sympy.Mod(r, 64)), r, 512) == 512
    assert _k_positions((i0,), r, 512) == 512  # not along K: counted by the caller


def test_stages_are_cut_until_the_pipeline_fits():
    config = GemmConfig(16, 64, 512, 8, 4)
    limit = H100_SXM.shared_memory_per_block  # 232,448 bytes
    # 3 x 82,944 + 16,384 = 265,216 > limit; 2 x 82,944 + 16,384 fits.
    assert fit_shared_memory(config, (82944, 16384), H100_SXM).num_stages == 3
    assert fit_shared_memory(config, (1024, 0), H100_SXM).num_stages == 4
    assert fit_shared_memory(config, (limit, 1), H100_SXM).num_stages == 1


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_decode_gemms_at_8_rows_fit_a_blocks_shared_memory_on_sm90(scheme):
    """TinyLlama's decode step (one layer) at batch 8, as the static report
    compiles it: every GEMM template kernel compiles for sm_90 within the
    shared memory a block may have, and the count is at least what Triton
    took; and the programs an SM holds by that count, which the cost model
    prices its waves with (``GemmConfig.k_loop``), by what Triton took too.
    bf16's gate/up product (its RMS norm in the prologue) takes 2 stages,
    one wave of two programs an SM (``gemm.fewest_waves``): with 4 it asked
    for 265,216 bytes."""
    from benchmarks import static_decode as sd
    from benchmarks.sm90 import compile_kernel
    from benchmarks.static import tilec_graphs
    from tilec.codegen.record import kernel_entry
    from tilec.gemm import _staged_bytes
    from tilec.options import Options

    decode = sd.decoder(8, 2048, sd.SHAPE | {"num_hidden_layers": 1})
    extra = {"gemv_reduction": True, "split_combine": True}
    options = Options.from_user(None, sd.step_options(scheme, extra))
    captured = sd.the_step(tilec_graphs(decode.step, decode.inputs, options))
    graph = captured.graph
    limit = H100_SXM.shared_memory_per_block
    checked = []
    for kernel in (k for k in captured.kernels if k.template == "gemm"):
        (dot,) = [graph.nodes[n] for n in kernel.group.nodes if graph.nodes[n].reduce_op == DOT]
        config = GemmConfig.of(kernel.launch)
        compiled = compile_kernel(kernel_entry(graph, kernel.group, kernel))
        assert compiled["ok"] and compiled["shared"] <= limit, (config, compiled)
        assert packing(graph, kernel.group.nodes, dot) == 1
        ahead, staged = _staged_bytes(graph, kernel.group, dot, config)
        assert staged_steps(config, H100_SXM) * ahead + staged >= compiled["shared"]
        took = cost.resident_programs(H100_SXM, compiled["shared"], config.num_warps)
        assert kernel.program_loop.resident <= took, (config, compiled["shared"])
        checked.append((config.block_n, config.num_stages))
    assert checked
    if scheme == "bf16":
        assert (64, 2) in checked  # the gate/up product


def test_a_left_operand_of_two_tiles_steps_256_at_8_rows_on_sm90():
    """``gemm.two_tile_left``: at 8 rows the down projection's prologue
    computes ``silu(gate) * up`` from two tiles; with steps of 512 sm_90
    spilled (bf16: 29,436 bytes), so the template steps 256 and compiles
    without a spill.  An RMS norm's left operand (one tile of x and a row of
    the norm's weight) keeps 512, as does one row."""
    import torch

    from benchmarks.sm90 import compile_kernel
    from tests.lowering import lower_with_constants, optimize
    from tilec.codegen.kernel import write_kernel
    from tilec.codegen.record import kernel_entry
    from tilec.gemm import template_config, two_tile_left
    from tilec.options import Options

    w = torch.randn(2048, 5632, dtype=torch.bfloat16)
    norm = torch.randn(5632, dtype=torch.bfloat16)
    options = Options.from_user(None, {"freeze": True, "matmul": "triton", "cudagraphs": True})

    def down(w, gate, up):
        return (torch.nn.functional.silu(gate) * up) @ w.t()

    def normed(w, norm, x):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (norm * (x.float() * rstd).to(torch.bfloat16)) @ w.t()

    def template(graph):
        gpu = optimize(graph, options, gpu=True)
        (group,) = [g for g in gpu.groups if any(gpu.nodes[n].reduce_op == DOT for n in g.nodes)]
        (dot,) = [gpu.nodes[n] for n in group.nodes if gpu.nodes[n].reduce_op == DOT]
        return gpu, group, dot

    for rows, steps in ((8, 256), (1, 512)):
        gate, up = (torch.randn(rows, 5632, dtype=torch.bfloat16) for _ in range(2))
        gpu, group, dot = template(lower_with_constants(down, (w,), gate, up))
        assert two_tile_left(gpu, group.nodes, dot) == (rows > 1)  # one row: no row tiles
        assert template_config(gpu, group, dot, H100_SXM).config.block_k == steps
        kernel = write_kernel(gpu, group, H100_SXM)
        if rows == 8:
            compiled = compile_kernel(kernel_entry(gpu, group, kernel))
            assert compiled["ok"] and not compiled.get("spill_bytes"), compiled
    x = torch.randn(8, 5632, dtype=torch.bfloat16)
    gpu, group, dot = template(lower_with_constants(normed, (w, norm), x))
    assert not two_tile_left(gpu, group.nodes, dot)
    assert template_config(gpu, group, dot, H100_SXM).config.block_k == 512
