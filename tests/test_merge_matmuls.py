"""Sibling linear layers merged into one matmul (``passes/merge_matmuls.py``),
against eager torch and the IR interpreter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tilec
from benchmarks.sm90 import compile_kernel
from benchmarks.zoo import MODELS
from tests.compare import assert_matches_eager
from tests.lowering import lower_with_constants, new_programs, optimize
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.interpret import interpret
from tilec.ir import is_matmul
from tilec.options import Options
from tilec.passes.merge_matmuls import merge_matmuls
from tilec.passes.quantize import quantize
from tilec.target import H100_SXM


def _siblings(wq, wk, wv, wo, other, x):
    """q, k, v read x; o reads q; ``other`` is read twice (by a matmul and an add)."""
    q, k, v = x @ wq.t(), x @ wk.t(), x @ wv.t()
    return (q @ wo.t()) * k.sum(-1, keepdim=True) + v.mean() + x @ other.t() + other.sum()


def _weights() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(n, 32) / 6 for n in (32, 16, 16, 32, 32))


def _matmuls(graph) -> list:
    return [n for n in graph.nodes.values() if is_matmul(n)]


def test_siblings_merge_into_one_matmul_and_compute_the_same():
    x = torch.randn(4, 32)
    weights = _weights()
    graph = lower_with_constants(_siblings, weights, x)
    merged, stats = merge_matmuls(graph)
    # q, k and v merged (two matmuls fewer); o reads q's slice; the weight
    # something else reads stays alone.
    assert stats == {"merged_matmuls": 2}
    shapes = sorted(n.shape for n in _matmuls(merged))
    assert shapes == [(4, 32), (4, 32), (4, 64)]
    (concat,) = [n for n, t in merged.constants.items() if t.shape == (64, 32)]
    assert merged.constant_names[concat] == "wq+wk+wv"
    expected = _siblings(*weights, x)
    torch.testing.assert_close(interpret(merged, [x])[0], expected)
    assert merge_matmuls(graph, enabled=False)[1] == {"merged_matmuls": 0}


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int4_weight_only"])
def test_quantized_siblings_merge_their_constants_row_for_row(scheme):
    """Each weight quantized alone, then its values and scales concatenated:
    the merged program computes what the unmerged one does."""
    x = torch.randn(4, 32)
    graph = lower_with_constants(_siblings, _weights(), x)
    quantized, _ = quantize(graph, scheme, group_size=32, head=True)
    merged, stats = merge_matmuls(quantized)
    assert stats == {"merged_matmuls": 2}
    names = {merged.constant_names[n] for n, t in merged.constants.items() if t.shape[0] == 64}
    assert names == {"wq+wk+wv"}  # values and scales
    torch.testing.assert_close(interpret(merged, [x])[0], interpret(quantized, [x])[0])


def test_merged_program_runs_its_kernels_like_eager():
    x = torch.randn(4, 32)
    weights = [nn.Parameter(w) for w in _weights()]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.ParameterList(weights)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _siblings(*self.w, x)

    assert_matches_eager(Model().eval(), x, options={"freeze": True})


def test_tiny_llama_merges_qkv_and_gate_up_and_matches_eager():
    spec = MODELS["llama"]
    torch.manual_seed(0)
    model = spec.build("tiny").model.eval()
    (ids,) = spec.inputs("tiny", 1, torch.Generator().manual_seed(0))
    before = set(tilec.programs())
    compiled = torch.compile(model, backend="tilec", options={"freeze": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-4)
    (program,) = new_programs(before)
    names = {program.graph.constant_names.get(n, "") for n in program.graph.constants}
    for layer in (0, 1):
        prefix = f"model.model.layers.{layer}."
        attention = "+".join(prefix + f"self_attn.{p}_proj.weight" for p in "qkv")
        mlp = "+".join(prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up"))
        assert {attention, mlp} <= names
    # Per layer: qkv, o, gate+up, down; and the head.
    assert len(_matmuls(program.graph)) == 2 * 4 + 1


def test_decode_gemv_tiles_fill_the_gpu():
    """On the H100 target, a one-row int8 product over the merged q/k/v
    weight (2560 columns) is tiled 16 columns wide (160 programs on 132
    SMs), and compiles for sm_90 without spills."""
    torch.manual_seed(0)
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    weights = tuple(torch.randn(n, 2048, dtype=torch.bfloat16) for n in (2048, 256, 256))

    def attention_inputs(q, k, v, x):
        return (x @ q.t())[:, :256] + (x @ k.t()) * (x @ v.t())

    graph = lower_with_constants(attention_inputs, weights, x)
    options = Options.from_user(
        None, {"quantize": "int8_weight_only", "freeze": True, "quantize_head": True}
    )
    gpu = optimize(graph, options, gpu=True)
    (gemm,) = [g for g in gpu.groups if g.shape == (1, 2560)]
    kernel = write_kernel(gpu, gemm, H100_SXM)
    assert kernel.launch.constexprs["BLOCK_N"] == 16 and kernel.launch.grid == (160,)
    compiled = compile_kernel(kernel_entry(gpu, gemm, kernel))
    assert compiled["ok"], compiled.get("error")
    assert not compiled.get("spill_bytes")
