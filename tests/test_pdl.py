"""Programmatic dependent launch (the option ``pdl``).

A kernel launched with it may start before the kernel it follows has
finished; it keeps the stream's order only if it waits
(``griddepcontrol.wait``) before its first access to global memory.  The
oracles: the PTX each kernel compiles to for sm_90 (the wait comes before
every global load, store and atomic, :func:`benchmarks.sm90.waits_first`,
which a kernel that loads before waiting fails), eager torch for programs
built with the option where it does not apply (the interpreter), and on a
GPU of compute capability 9.0+ the same program without the option, bit for
bit."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from benchmarks.sm90 import compile_kernel, waits_first
from benchmarks.static import tilec_graphs
from tests.lowering import gpu_kernels
from tests.test_attention_cache import Step
from tilec.codegen.cache import write_source
from tilec.codegen.launch import DEPENDENT_START
from tilec.codegen.record import ENV, kernel_entry, record_kernel, sizes_in_memory_entry
from tilec.options import Options
from tilec.pipeline import programs
from tilec.target import H100_SXM, from_properties


def _step_kernels(pdl: bool) -> list:
    """The GPU kernels of decode steps of grouped-query attention with a
    static cache and GEMM templates: at a small shape (GEMM templates, a
    scatter, the attention template) and a larger one (combined kernels)."""
    torch.manual_seed(0)
    kernels = []
    for shape in ({}, {"dim": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "cache": 512}):
        step = Step(**shape).eval()
        inputs = (torch.randn(1, 1, shape.get("dim", 32)), torch.tensor([3]))
        options = Options(pdl=pdl, matmul="triton")
        for captured in tilec_graphs(step, inputs, options):
            kernels += [(captured.graph, kernel) for kernel in captured.kernels]
    return kernels


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return F.softmax(x * 2, dim=-1)


@pytest.fixture(scope="module")
def compiled() -> list[tuple[str, dict]]:
    """Every kernel of the decode steps and of a generic (symbolic-size)
    softmax, with its variant reading sizes from memory, written for an
    H100 with ``pdl`` and compiled for sm_90."""
    entries = []
    for graph, kernel in _step_kernels(True):
        entries.append((kernel.template, kernel_entry(graph, kernel.group, kernel)))
    generic = gpu_kernels(_softmax, torch.randn(8, 40), generic=True, options=Options(pdl=True))
    for graph, kernel in generic:
        entry = kernel_entry(graph, kernel.group, kernel)
        entries += [("generic", entry), ("sizes in memory", sizes_in_memory_entry(entry, kernel))]
    return [(template, compile_kernel(entry)) for template, entry in entries]


def test_every_kernel_waits_before_touching_memory(compiled):
    templates = {template for template, _ in compiled}
    assert {"gemm", "scatter", "attention", "combined", "generic", "sizes in memory"} <= templates
    for template, result in compiled:
        assert result["ok"], (template, result.get("error"))
        assert result["waits_first"] is True, (template, result["name"])


def test_launches_ask_for_pdl_and_kernels_start_with_the_wait():
    with_pdl, without = _step_kernels(True), _step_kernels(False)
    assert len(with_pdl) == len(without)
    for (_, kernel), (_, plain) in zip(with_pdl, without):
        assert kernel.launch.pdl and kernel.launch.options["launch_pdl"] is True
        assert "launch_pdl" not in plain.launch.options
        assert "gdc_wait" not in plain.source
        # The kernel function (the module's last) starts with the wait.
        body = kernel.source.split(f"def {kernel.function}(")[1].splitlines()[1:3]
        assert [line.strip() for line in body] == list(DEPENDENT_START)
        assert kernel.function != plain.function


def test_waits_first_fails_a_kernel_that_loads_before_it_waits():
    """The check itself: a kernel with a load before its wait fails it; one
    without any wait fails it; the ordered one passes."""
    sources = {
        "late": ["x = tl.load(src + offs)", "tl.extra.cuda.gdc_wait()", "tl.store(dst + offs, x)"],
        "never": ["x = tl.load(src + offs)", "tl.store(dst + offs, x)"],
        "first": ["tl.extra.cuda.gdc_wait()", "x = tl.load(src + offs)", "tl.store(dst + offs, x)"],
    }
    results = {}
    for name, body in sources.items():
        lines = [
            "import triton",
            "import triton.language as tl",
            "@triton.jit",
            f"def copy_{name}(src, dst, BLOCK: tl.constexpr):",
            "    offs = tl.arange(0, BLOCK)",
            *(f"    {line}" for line in body),
        ]
        entry = {
            "source": "\n".join(lines) + "\n",
            "name": f"copy_{name}",
            "signature": {"src": "*fp32", "dst": "*fp32"},
            "constexprs": {"BLOCK": 128},
            "num_warps": 4,
            "num_stages": 3,
            "launch_pdl": True,
        }
        write_source(entry["source"])
        result = compile_kernel(entry)
        assert result["ok"], result.get("error")
        results[name] = result["waits_first"]
    assert results == {"late": False, "never": False, "first": True}
    assert waits_first("griddepcontrol.wait;\nld.param.u64 %rd1, [p];\nld.global.f32 %f1, [%rd1];")
    assert not waits_first("red.global.add.f32 [%rd1], %f1;\ngriddepcontrol.wait;")


def test_the_recorded_kernel_keeps_pdl(tmp_path, monkeypatch):
    """The PTX tier compiles what was launched: a kernel written with pdl is
    recorded with it (and rewritten for the recorded GPU with it: the source
    check of ``record.gpu_launch`` passes)."""
    log = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(ENV, str(log))
    graph, kernel = _step_kernels(True)[0]
    record_kernel(graph, kernel.group, kernel, H100_SXM)
    (entry,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert entry["launch_pdl"] is True and entry["source"] == kernel.source


def test_the_option_is_a_bool_and_off_by_default():
    assert Options().pdl is False
    assert Options.from_user(None, {"pdl": True}).pdl is True
    with pytest.raises(TypeError, match="'pdl' must be a bool"):
        Options.from_user(None, {"pdl": 1})


def _properties(major: int, minor: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="NVIDIA Test GPU",
        major=major,
        minor=minor,
        multi_processor_count=100,
        max_threads_per_multi_processor=2048,
    )


def test_only_cuda_gpus_of_capability_9_have_it(monkeypatch):
    assert H100_SXM.programmatic_launch
    assert not from_properties(_properties(8, 0), tf32=False).programmatic_launch
    assert from_properties(_properties(9, 0), tf32=False).programmatic_launch
    assert from_properties(_properties(10, 0), tf32=False).programmatic_launch
    # ROCm reports gfx numbers as capabilities (gfx942: 9.4).
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert not from_properties(_properties(9, 4), tf32=False).programmatic_launch


def test_on_a_cpu_the_option_is_off_and_the_summary_says_why(tmp_path):
    """The interpreter has no programmatic dependent launch: the program is
    the one without the option (equal to eager), and its summary says so."""
    torch._dynamo.reset()
    before = set(programs())
    compiled = torch.compile(
        _softmax, backend="tilec", options={"pdl": True, "dump": str(tmp_path)}
    )
    x = torch.randn(8, 40)
    torch.testing.assert_close(compiled(x), _softmax(x))
    (program,) = [p for name, p in programs().items() if name not in before]
    assert not any(step.kernel.launch.pdl for step in program.launches())
    (summary,) = tmp_path.glob("*/summary.txt")
    line = "programmatic dependent launch (pdl): off: the Triton interpreter has no "
    assert line in summary.read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["calls", "cudagraphs"])
def test_on_a_gpu_results_equal_those_without_it(graphs):
    """On a GPU that has it, every launch asks for it, and a decode step's
    outputs and caches equal those of the same program without it, bit for
    bit, over several steps (called, or captured and replayed)."""
    if not from_properties(torch.cuda.get_device_properties(0), False).programmatic_launch:
        pytest.skip("this GPU has no programmatic dependent launch (compute capability < 9.0)")
    torch._dynamo.reset()
    torch.manual_seed(0)
    shape = {"dim": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "cache": 512}
    models, runs = [], []
    for pdl in (False, True):
        torch.manual_seed(0)
        model = Step(**shape).eval().to("cuda", torch.bfloat16)
        before = set(programs())
        compiled = torch.compile(model, backend="tilec", options={"pdl": pdl, "cudagraphs": graphs})
        outputs = []
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for position in (0, 1, 5, 511, 2):
                x = torch.randn(1, 1, 256, generator=g).to("cuda", torch.bfloat16)
                outputs.append(compiled(x, torch.tensor([position], device="cuda")).clone())
        torch.cuda.synchronize()
        (program,) = [p for name, p in programs().items() if name not in before]
        assert all(step.kernel.launch.pdl == pdl for step in program.launches())
        models.append(model)
        runs.append(outputs)
    for got, want in zip(runs[1], runs[0]):
        assert torch.equal(got, want)
    assert torch.equal(models[1].k_cache, models[0].k_cache)
    assert torch.equal(models[1].v_cache, models[0].v_cache)
