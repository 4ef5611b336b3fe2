"""Split-K for products of few rows (``passes/split_k.py``), against eager
torch and the IR interpreter; the split kernel compiled for sm_90."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tilec
from benchmarks.sm90 import compile_kernel
from tests.compare import run_tilec
from tests.lowering import lower_with_constants, new_programs, optimize
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.gemm import DOT
from tilec.options import Options
from tilec.target import H100_SXM


def _linear(n: int, k: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, n, bias=False), nn.GELU()).eval()


def _program(model: nn.Module, x: torch.Tensor, **options):
    before = set(tilec.programs())
    out = run_tilec(model, x, options={"freeze": True, **options})
    (program,) = new_programs(before)
    return out, program


def _dots(graph) -> list:
    return [n for n in graph.nodes.values() if n.reduce_op == DOT]


@pytest.mark.parametrize("rows", [1, 3])
def test_a_one_row_product_over_few_columns_is_split_over_k(rows):
    """256 columns are 4 tiles of the interpreter's 64: K = 2048 is split
    into 8 chunks of 256 (32 programs), summed with the GELU epilogue."""
    model, x = _linear(256, 2048), torch.randn(rows, 2048)
    out, program = _program(model, x, matmul="triton")
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    (dot,) = _dots(program.graph)
    assert dot.shape == (8, rows, 256) and dot.reduce_shape == (256,)
    templates = [(s.kernel.template, s.kernel.launch.grid) for s in program.launches()]
    assert templates == [("gemm", (32,)), ("persistent", (1,))]
    torch._dynamo.reset()
    interpreted = run_tilec(
        model, x, options={"freeze": True, "matmul": "triton", "interpret": True}
    )
    torch.testing.assert_close(interpreted, out, rtol=1e-6, atol=1e-6)


def test_an_int8_weight_is_dequantized_per_chunk():
    """The weight's dequantization stays the split product's prologue: the
    program computes what it computes unsplit."""
    model, x = _linear(256, 2048), torch.randn(1, 2048)
    options = {"quantize": "int8_weight_only", "quantize_head": True}
    out, program = _program(model, x, **options)
    (dot,) = _dots(program.graph)
    assert dot.shape[0] == 8
    torch._dynamo.reset()
    unsplit, _ = _program(model, torch.cat([x] * 17), **options)  # 17 rows: not split
    torch.testing.assert_close(out, unsplit[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, columns", [(17, 256), (1, 8192)])
def test_many_rows_or_enough_tiles_are_not_split(rows, columns):
    model, x = _linear(columns, 512), torch.randn(rows, 512)
    out, program = _program(model, x, matmul="triton")
    (dot,) = _dots(program.graph)
    assert len(dot.shape) == 2
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda graphs", "launched"])
def test_on_the_h100_a_decode_gemv_is_split_where_it_pays(graphs):
    """One bf16 row against an int8 [256, 2048] weight: 16 tiles of 16
    columns.  Replayed in a CUDA graph (0.66 us a launch), splitting by 4
    (64 programs; a chunk is whole K steps of 512) and a sum's kernel is
    predicted faster and taken; the
    kernel compiles for sm_90 without spills.  Launched one by one (2.5 us
    a launch) the extra launch costs more than the fuller grid wins."""
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    w = torch.randn(256, 2048, dtype=torch.bfloat16)
    graph = lower_with_constants(lambda w, x: x @ w.t(), (w,), x)
    options = {"quantize": "int8_weight_only", "freeze": True, "quantize_head": True}
    gpu = optimize(graph, Options.from_user(None, options | {"cudagraphs": graphs}), gpu=True)
    (dot,) = _dots(gpu)
    if not graphs:
        assert dot.shape == (1, 256)
        return
    assert dot.shape == (4, 1, 256)
    (group,) = [g for g in gpu.groups if dot.name in g.nodes]
    kernel = write_kernel(gpu, group, H100_SXM)
    assert kernel.launch.grid == (64,)
    compiled = compile_kernel(kernel_entry(gpu, group, kernel))
    assert compiled["ok"], compiled.get("error")
    assert not compiled.get("spill_bytes")


def test_on_the_h100_a_few_row_int4_product_splits_its_long_k_loop(monkeypatch):
    """8 rows against an int4 [2048, 5632] weight (TinyLlama's down
    projection): 32 tiles of 64 columns (``gemm.packed_alternative``: 256
    positions a step, 8 warps) or 128 of 16 fill few SMs, and each K loop
    takes 22 steps of 256 positions, which bound it.  Split in 11 (352
    programs of 64 columns, two steps each) it is predicted faster with
    the sum's kernel, as the static report prices the kernels written
    (``benchmarks.static.kernel_prediction``, replayed launches), than
    whole and than split in two on 16-column tiles (the choice before the
    64-column alternative at more than one row); the split kernel
    compiles for sm_90 without a spill."""
    gpu, dot, split, whole = _split_and_whole("int4_weight_only", monkeypatch)
    assert dot.shape == (11, 8, 2048) and dot.reduce_shape == (512,)
    (gemm,) = [(g, k) for g, k in split if k.template == "gemm"]
    constexprs = gemm[1].launch.constexprs
    assert (constexprs["BLOCK_N"], constexprs["BLOCK_K"], gemm[1].launch.num_warps) == (64, 256, 8)
    assert gemm[1].launch.grid == (352,)
    compiled = compile_kernel(kernel_entry(gpu, *gemm))
    assert compiled["ok"] and not compiled.get("spill_bytes"), compiled
    assert len(split) == len(whole) + 1
    assert _replayed_seconds(split) < _replayed_seconds(whole)
    monkeypatch.undo()  # split-K again
    narrow = _split_and_whole("int4_weight_only", monkeypatch, narrow=True)
    assert narrow[1].shape == (2, 8, 2048)
    assert _replayed_seconds(split) < _replayed_seconds(narrow[2])


def _split_and_whole(scheme: str, monkeypatch, narrow: bool = False) -> tuple:
    """8 bf16 rows against TinyLlama's down projection's [2048, 5632]
    weight quantized by ``scheme``, on the H100 under CUDA graphs: the
    optimized graph, its one dot, its kernels as split-K leaves them and
    its kernels unsplit (``_splits`` patched to 1 for the second);
    ``narrow``: an int4 weight's few-row tiles never 64 columns wide."""
    from tilec import gemm as gemm_rules
    from tilec.passes import split_k

    if narrow:
        monkeypatch.setattr(gemm_rules, "packed_alternative", lambda *args: None)

    x = torch.randn(8, 5632, dtype=torch.bfloat16)
    w = torch.randn(2048, 5632, dtype=torch.bfloat16)
    graph = lower_with_constants(lambda w, x: x @ w.t(), (w,), x)
    options = {"quantize": scheme, "freeze": True, "quantize_head": True, "cudagraphs": True}
    options = Options.from_user(None, options)

    def kernels(gpu):
        return [(g, write_kernel(gpu, g, H100_SXM)) for g in gpu.groups]

    gpu = optimize(graph, options, gpu=True)
    (dot,) = _dots(gpu)
    split = kernels(gpu)
    monkeypatch.setattr(split_k, "_splits", lambda *args: 1)
    return gpu, dot, split, kernels(optimize(graph, options, gpu=True))


def _replayed_seconds(kernels: list) -> float:
    """The predicted seconds of ``kernels`` replayed, as the static report prices them."""
    from benchmarks.static import kernel_prediction
    from benchmarks.static_decode import replayed_seconds

    return sum(replayed_seconds(kernel_prediction(k)) for _, k in kernels)


def test_k_splits_into_any_count_of_whole_chunks():
    """K = 5632 is 11 x 512: not split by a power of two alone.  In the
    interpreter (BLOCK_K 16 for fp32, no figures) 2 tiles of one row take
    the most chunks of at least 256: 22; the result matches eager and the
    IR interpreter."""
    model, x = _linear(128, 5632), torch.randn(1, 5632)
    out, program = _program(model, x, matmul="triton")
    (dot,) = _dots(program.graph)
    assert dot.shape == (22, 1, 128) and dot.reduce_shape == (256,)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    interpreted = run_tilec(
        model, x, options={"freeze": True, "matmul": "triton", "interpret": True}
    )
    torch.testing.assert_close(interpreted, out, rtol=1e-6, atol=1e-6)


def test_on_the_h100_a_gemv_of_11_k_steps_splits_into_11():
    """One bf16 row against a [128, 5632] weight on the H100: 8 tiles of 16
    columns, each 11 K steps of 512.  Split into 11 chunks of one step (88
    programs, one wave) it is predicted faster, and taken; the split
    kernel compiles for sm_90 without spills."""
    x = torch.randn(1, 5632, dtype=torch.bfloat16)
    w = torch.randn(128, 5632, dtype=torch.bfloat16)
    graph = lower_with_constants(lambda w, x: x @ w.t(), (w,), x)
    options = Options.from_user(None, {"freeze": True, "matmul": "triton", "cudagraphs": True})
    gpu = optimize(graph, options, gpu=True)
    (dot,) = _dots(gpu)
    assert dot.shape == (11, 1, 128) and dot.reduce_shape == (512,)
    (group,) = [g for g in gpu.groups if dot.name in g.nodes]
    kernel = write_kernel(gpu, group, H100_SXM)
    assert kernel.launch.grid == (88,)
    compiled = compile_kernel(kernel_entry(gpu, group, kernel))
    assert compiled["ok"] and not compiled.get("spill_bytes"), compiled


def test_on_the_h100_a_few_row_int8_product_splits_past_one_wave(monkeypatch):
    """8 rows against an int8 [2048, 5632] weight (TinyLlama's down
    projection): 128 tiles of 16 columns, 11 K steps of 512 each.  Split
    into 11 chunks of one step, 1408 programs are several waves of what an
    SM holds, and still predicted faster (the K loop, not the bytes, bound
    it unsplit), as the static report prices the kernels written; the
    split kernel compiles for sm_90 without a spill, in no more registers
    than the cost model counts programs an SM by."""
    from tilec import cost

    gpu, dot, split, whole = _split_and_whole("int8_weight_only", monkeypatch)
    assert dot.shape == (11, 8, 2048) and dot.reduce_shape == (512,)
    (gemm,) = [(g, k) for g, k in split if k.template == "gemm"]
    assert gemm[1].launch.grid == (1408,)
    loop = gemm[1].program_loop
    assert 1408 > H100_SXM.sm_count * loop.resident  # more than one wave
    compiled = compile_kernel(kernel_entry(gpu, *gemm))
    assert compiled["ok"] and not compiled.get("spill_bytes"), compiled
    held = cost.resident_programs(
        H100_SXM, compiled["shared"], gemm[1].launch.num_warps, compiled["registers"]
    )
    assert held >= loop.resident
    assert _replayed_seconds(split) < _replayed_seconds(whole)


def test_a_split_products_prologue_is_priced_once_per_chunk():
    """An int8 weight's dequantization in a product split into 43 chunks
    (8 rows against Llama-2-7B's down projection, K 11008 = 43 x 256):
    each chunk dequantizes its own slice of the weight, not the whole, so
    the dequantization stays the split product's prologue and the bf16
    weight is never written (it was: 135 MB a step, priced as 43 times
    the whole weight's work)."""
    x = torch.randn(8, 11008, dtype=torch.bfloat16)
    w = torch.randn(4096, 11008, dtype=torch.bfloat16)
    graph = lower_with_constants(lambda w, x: x @ w.t(), (w,), x)
    options = {"quantize": "int8_weight_only", "freeze": True, "quantize_head": True}
    gpu = optimize(graph, Options.from_user(None, options | {"cudagraphs": True}), gpu=True)
    (dot,) = _dots(gpu)
    assert dot.shape[0] > 2  # split
    (group,) = [g for g in gpu.groups if dot.name in g.nodes]
    assert len(group.nodes) > 1  # the dequantization with it
    stored = {n for g in gpu.groups for n in g.stored}
    assert not any(gpu.nodes[n].dtype == torch.bfloat16 and gpu.nodes[n].shape == (4096, 11008)
                   for n in stored)  # fmt: skip
