"""The static GPU report (``benchmarks/static.py``) and the fixes it drove:
size-1 dimensions (batch 1) fuse, address and reuse memory as size 2 does."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tilec
from benchmarks import static
from benchmarks.sm90 import compile_kernel, occupancy, vector_accesses
from benchmarks.zoo import MODELS
from examples.tiny_gpt import Block, GPTConfig
from tests.compare import assert_matches_eager
from tests.lowering import gpu_kernels, lower, new_programs, optimize
from tilec.codegen.record import kernel_entry
from tilec.options import Options


def _zoo(name: str, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = MODELS[name].build("tiny").model.eval()
    return model, MODELS[name].inputs("tiny", batch, torch.Generator().manual_seed(0))


def _gpu_launches(name: str, batch: int) -> int:
    return sum(len(c.kernels) for c in static.tilec_graphs(*_zoo(name, batch)))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_batch_one_fuses_as_batch_two(name):
    """Size-1 dimensions are the node's own position: layer norms at batch 1
    fuse exactly as at batch 2 (it was 19 kernels against 9 on GPT-2)."""
    torch.backends.mha.set_fastpath_enabled(False)
    assert _gpu_launches(name, 1) == _gpu_launches(name, 2)


def test_batch_one_block_matches_eager_with_no_more_kernels_than_batch_two():
    torch.manual_seed(0)
    config = GPTConfig()
    block = Block(config).eval()
    counts = []
    for batch in (2, 1):
        torch._dynamo.reset()

        tilec.reset_stats()
        x = torch.randn(batch, 16, config.n_embd)
        assert_matches_eager(block, x, atol=1e-4, rtol=1e-4)
        counts.append(tilec.stats()["kernels"])
    # A size-1 dimension may make a view trivial; it never blocks a fusion.
    assert counts[1] <= counts[0]


def test_batch_one_layer_norm_reads_and_writes_as_batch_two():
    """A (1, 8, 64) layer norm loads each element once and addresses rows
    flat (``64 * x + r``: vector loads on a GPU), as (2, 8, 64) does."""

    def layer_norm(x, w):
        return torch.nn.functional.layer_norm(x, (64,), w) * 2

    accesses = []
    for batch in (2, 1):
        ((_, kernel),) = gpu_kernels(layer_norm, torch.randn(batch, 8, 64), torch.randn(64))
        lines = kernel.source.splitlines()
        accesses.append(
            [
                re.sub(r"^\s*t\d+ = |, t\d+,", "", ln)
                for ln in lines
                if "tl.load(" in ln or "tl.store(" in ln
            ]
        )
    assert accesses[0] == accesses[1]
    assert "64 * x + r" in accesses[0][0]


def test_norm_kernel_stores_a_transposed_copy_itself():
    """ViT's attention (batch_first) transposes the layer norm's output and
    copies it for the in-projection: the norm's kernel stores the transposed
    copy at the tile position it reads (one kernel, as at batch 1)."""

    def norm_then_transpose(x, w):
        h = torch.nn.functional.layer_norm(x, (16,))
        return h.transpose(0, 1).contiguous().view(-1, 16) @ w

    x, w = torch.randn(3, 5, 16), torch.randn(16, 8)
    ((graph, kernel),) = gpu_kernels(norm_then_transpose, x, w)
    (out,) = [a for a in kernel.args if a.is_output]
    assert graph.nodes[out.buffer].shape == (5, 3, 16)
    assert_matches_eager(norm_then_transpose, x, w, atol=1e-5, rtol=1e-5)


def test_widening_cast_is_recomputed_not_stored():
    """A bf16 group norm upcasts its input to float32 for the statistics and
    the normalisation: each kernel reads the bf16 input and converts it,
    nothing stores the float32 copy (it doubled the bytes of unet_block)."""

    def group_norm_like(x):
        xf = x.float()
        var = xf.view(2, 4, -1).var(-1)
        return var, (xf * 2).to(torch.bfloat16)

    x = torch.randn(2, 8, 4, 4).to(torch.bfloat16)
    kernels = gpu_kernels(group_norm_like, x)
    stored = [(g.nodes[a.buffer].shape, a.dtype) for g, k in kernels for a in k.args if a.is_output]
    assert stored and ((2, 8, 4, 4), torch.float32) not in stored
    read = sum(k.bytes_read for _, k in kernels)
    assert read == 2 * x.nbytes  # two kernels, each loads the bf16 input once
    assert_matches_eager(group_norm_like, x, atol=1e-2, rtol=1e-2)


def test_copies_only_library_calls_read_are_not_kernels():
    """T5 copies its permuted keys and values (a KV-cache ``cat`` with an
    empty past) only for attention to read them: a library call takes any
    strides, so the copies go (they were 24 of T5's 71 launches)."""

    def attention(q, k, v):
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        k = torch.cat([k[:, :, :0], k], dim=2)
        v = torch.cat([v[:, :, :0], v], dim=2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 8, 4, 16), torch.randn(2, 8, 4, 16)
    assert gpu_kernels(attention, q, k, v) == []
    assert_matches_eager(attention, q, k, v, atol=1e-5, rtol=1e-5)


def test_pooling_window_shares_the_normalisation_parameters():
    """ResNet's batch norm + ReLU + 3x3/2 max pool is one kernel that reads
    the window's 9 taps; each tap's load is masked (padding), but the
    per-channel parameters are in bounds everywhere, so they are loaded and
    turned into a scale once, not once per tap (173 -> 114 registers at
    full size)."""

    def bn_relu_pool(x, mean, var, w, b):
        h = torch.nn.functional.batch_norm(x, mean, var, w, b)
        return torch.nn.functional.max_pool2d(torch.relu(h), 3, 2, 1)

    x = torch.randn(2, 4, 8, 8)
    params = (torch.randn(4), torch.rand(4) + 0.5, torch.randn(4), torch.randn(4))
    ((_, kernel),) = gpu_kernels(bn_relu_pool, x, *params)
    body = kernel.source.split(f"def {kernel.function}(")[1]
    assert body.count("tl.load(") == 9 + len(params)
    # torch 2.14 decomposes batch norm with rsqrt, earlier releases with sqrt.
    assert body.count("tl.sqrt(") + body.count("tl.rsqrt(") == 1
    assert_matches_eager(bn_relu_pool, x, *params, atol=1e-5, rtol=1e-5)


def test_ideal_bytes_is_a_lower_bound_and_report_fields(tmp_path):
    """On tiny models the kernels never move fewer bytes than the ideal lower bound."""
    torch.backends.mha.set_fastpath_enabled(False)
    for name in ("gpt2", "resnet18", "mlp"):
        model, inputs = _zoo(name, 1)
        side = static.tilec_side(static.tilec_graphs(model, inputs), jobs=1)
        assert 0 < side["ideal_bytes"] <= side["kernel_bytes"], name
        assert not side["failed_compiles"] and not side["spilling_kernels"], name
        for row in side["kernels"]:
            assert row["registers"] > 0 and 0 < row["occupancy"] <= 1
            assert row["predicted_s"] >= static.CONSTANTS["launch_s"][0]


def test_a_gemm_counted_at_more_programs_an_sm_than_its_compile_holds_is_named():
    """The zoo and decode reports' check of the cost model's programs an SM
    (``GemmConfig.k_loop``) against the sm_90 compile: a 128 x 128 bf16
    tile, counted two programs an SM, holds two as compiled; had it taken
    255 registers a thread (8 warps), one."""
    a, b = torch.randn(256, 256).bfloat16(), torch.randn(256, 256).bfloat16()
    ((graph, kernel),) = gpu_kernels(lambda a, b: a @ b, a, b, options=Options(matmul="triton"))
    assert kernel.template == "gemm" and kernel.program_loop.resident == 2
    compiled = compile_kernel(kernel_entry(graph, kernel.group, kernel))
    assert compiled["ok"] and compiled["registers"] <= 128
    assert static.programs_overcounted(kernel, compiled) is None
    assert static.programs_overcounted(kernel, {**compiled, "registers": 255}) == [2, 1]


def test_library_calls_are_costed_by_flops_and_bytes():
    model, inputs = _zoo("mlp", 4)
    (captured,) = static.tilec_graphs(model, inputs)
    calls = static.library_calls(captured.graph)
    templated = static.templated_matmuls(captured.graph)
    # Three linear layers 32 -> 64 -> 64 -> 10 at batch 4: 2*M*N*K FLOPs each
    # (each followed by a layer norm: nothing for a GEMM template's epilogue).
    assert not templated
    assert sorted(c["flops"] for c in calls) == sorted(
        2 * 4 * k * n for k, n in ((32, 64), (64, 64), (64, 10))
    )
    assert all(c["bytes"] > 0 for c in calls)


def test_attention_is_counted_as_the_gpu_would_run_it():
    """Traced on CPU tensors, attention is the CPU flash op, whose FLOPs
    torch's counter leaves at zero: the report counts the CUDA op's,
    4 * B * H * L * L * D (two products), causal or not."""
    q, k, v = (torch.randn(2, 4, 64, 32) for _ in range(3))

    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    (call,) = static.library_calls(optimize(lower(attention, q, k, v), gpu=True))
    assert "flash_attention_for_cpu" in call["op"]
    assert call["flops"] == 4 * 2 * 4 * 64 * 64 * 32
    # In bf16 at a compute-bound size: priced at the attention rate, below
    # the GEMM rate of the same FLOPs.
    big = dict(call, dtype="torch.bfloat16", flops=call["flops"] * 4096)
    rate = static.CONSTANTS["attention_flops_per_s"][0]
    assert static.library_time([big]) >= big["flops"] / rate
    assert static.library_time([big]) > static.library_time([dict(big, op="aten.mm.default")])


def test_gemm_templates_are_priced_as_gemms_on_both_sides():
    """A matmul with a ReLU after it is a GEMM template for a GPU: its kernel
    is priced by its FLOPs and bytes, and Inductor's side pays it as the
    library call it replaced."""
    x, w, b = torch.randn(64, 256), torch.randn(256, 512), torch.randn(512)
    triton = Options(matmul="triton")  # auto predicts the library faster here (fp32, 8 tiles)
    ((graph, kernel),) = gpu_kernels(lambda x, w, b: torch.relu(x @ w + b), x, w, b, options=triton)
    assert kernel.template == "gemm"
    assert 2 * 64 * 256 * 512 <= kernel.flops <= 2 * 64 * 256 * 512 + 4 * 64 * 512
    (call,) = static.templated_matmuls(graph)
    assert call["flops"] == 2 * 64 * 256 * 512
    assert call["bytes"] == 4 * (64 * 256 + 256 * 512 + 64 * 512)
    # The kernel at the template's fp32 rate; Inductor's side at the library's.
    template = static.kernel_prediction(kernel)
    assert template.bound == "compute"
    assert template.compute_s > kernel.flops / static.CONSTANTS["gemm_flops_per_s_float32"][0]
    assert static.library_time([call]) < template.seconds


def test_vector_width_and_occupancy_arithmetic():
    ptx = "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\nld.global.b32 %r5, [%rd2];\n"
    ptx += "st.global.v2.b32 [%rd3], {%r1, %r2};\nld.global.nc.v2.b64 {%rd4, %rd5}, [%rd6];\n"
    ptx += "ld.global.b8 %rs1, [%rd7];\n"
    ptx += "cp.async.cg.shared.global [ %r6 + 0 ], [ %rd8 + 0 ], 0x10, %r7;\n"
    ptx += "cp.async.ca.shared.global [ %r8 + 0 ], [ %rd9 + 0 ], 0x4;\n"
    assert vector_accesses(ptx) == {
        "loads": 4,
        "loads_128": 2,
        "loads_8": 1,
        "stores": 1,
        "stores_128": 0,
        "copies": 2,
        "copies_128": 1,
    }
    assert occupancy(32, 4, 0) == 1.0  # 2048 threads of 32 registers fill an SM
    assert occupancy(128, 4, 0) == 0.25  # 65536 / (128 * 128) = 4 blocks of 4 warps
    assert occupancy(32, 8, 100 * 1024) == 2 * 8 / 64  # shared memory: 2 blocks


def test_report_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "report"
    assert static.main(["--model", "mlp", "--no-inductor", "--jobs", "1", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert "PREDICTIONS FROM STATIC ANALYSIS" in report["notice"]
    assert set(report["constants"]) == set(static.CONSTANTS)
    (mlp,) = report["results"]
    assert mlp["tilec"]["launches"] == 2 and len(mlp["tilec"]["library_calls"]) == 3
    text = (out / "report.md").read_text()
    assert "PREDICTIONS FROM STATIC ANALYSIS" in text and "| mlp |" in text
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_without_out_the_report_goes_under_the_current_directory(tmp_path, monkeypatch, capsys):
    """Not beside the committed reports in benchmarks/results."""
    monkeypatch.chdir(tmp_path)
    assert static.main(["--model", "mlp", "--no-inductor", "--jobs", "1"]) == 0
    out = tmp_path / "static-report" / "tiny-b2-float32"
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.png"}
    assert f"wrote {out.resolve()}/report.json" in capsys.readouterr().out


def test_identical_layers_share_one_kernel():
    """Three identical layers: one kernel source, one compiled function, three
    launches (each layer's kernel was a source of its own)."""
    torch.manual_seed(0)

    def layer() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))

    model = torch.nn.Sequential(layer(), layer(), layer()).eval()
    before = set(tilec.programs())
    assert_matches_eager(model, torch.randn(4, 16), atol=1e-5, rtol=1e-5)
    (program,) = new_programs(before)
    launches = program.launches()
    assert len(launches) == 3
    assert len({launch.kernel.name for launch in launches}) == 3  # told apart in dumps
    assert len({launch.kernel.source for launch in launches}) == 1
    assert len({id(launch.fn) for launch in launches}) == 1


def test_bert_layers_compile_once_for_the_gpu():
    torch.backends.mha.set_fastpath_enabled(False)
    kernels = [k for c in static.tilec_graphs(*_zoo("bert", 2)) for k in c.kernels]
    distinct = {k.source for k in kernels}
    # Two encoder layers of the same shapes: every layer kernel appears twice.
    assert len(distinct) < len(kernels)


def test_costliest_kernels_sum_over_launches_of_one_source():
    """A source launched once per layer costs all its launches: 12 cheap
    launches of one function outrank one dearer kernel."""
    rows = [
        {"graph": "g", "kernel": f"tilec_k{n}", "function": "tilec_aaa", "predicted_s": 1e-6}
        for n in range(12)
    ]
    rows.append({"graph": "g", "kernel": "tilec_k12", "function": "tilec_bbb", "predicted_s": 5e-6})
    (first, launches, total), (second, once, dear) = static.costliest(rows, count=2)
    assert (first["kernel"], launches, second["kernel"], once) == ("tilec_k0", 12, "tilec_k12", 1)
    assert total == pytest.approx(12e-6) and dear == pytest.approx(5e-6)


def test_inductor_bytes_are_each_kernels_own_estimate():
    """Inductor's side is priced by each kernel's own estimate (the
    positions its accesses reach), the scheduler's count only where a kernel
    has none; GPT-2's kernels all have one, and the kernel that gathers the
    token embeddings reads their rows, not the table the scheduler counts."""
    from benchmarks.inductor_gpu import InductorKernel, inductor_gpu_kernels

    kernel = InductorKernel(name="k", source="", bytes=100, launches=2, kernel_bytes=40)
    assert static.inductor_bytes(kernel) == (40, "kernel")
    combo = InductorKernel(name="c", source="", bytes=100, launches=1)
    assert static.inductor_bytes(combo) == (100, "scheduler")
    assert static.inductor_bytes(InductorKernel("u", "", None, 1)) == (None, None)

    torch.backends.mha.set_fastpath_enabled(False)
    model, inputs = _zoo("gpt2", 1)
    report = inductor_gpu_kernels(model, inputs)
    side = static.inductor_side(report)
    assert side["scheduler_counted"] == 0
    assert side["kernel_bytes"] == sum(k.kernel_bytes * k.launches for k in report.kernels)
    table = model.model.transformer.wte.weight
    gathers = [k for k in report.kernels if "embedding" in k.name]
    assert gathers
    for k in gathers:
        assert k.bytes >= table.numel() * table.element_size() > k.kernel_bytes, k
