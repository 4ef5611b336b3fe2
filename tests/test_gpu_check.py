"""``python -m benchmarks.gpu_check``: the one GPU command, run here as its
``--dry-run`` (the same sections on the CPU), and the pieces it is made of."""

from __future__ import annotations

import gc
import json
import math
import time

import pytest
import torch
import triton

import tilec
from benchmarks import gpu_check, gpu_sections
from benchmarks.gpu_report import TITLES, markdown
from benchmarks.gpu_timing import Section, capture_launches, time_launch
from benchmarks.zoo_gemms import Gemm, model_gemms, zoo_gemms
from tests.lowering import gpu_kernels
from tilec.options import Options
from tilec.target import Target


def test_the_prediction_is_the_cost_model_on_an_h100():
    """A bf16 GEMM template at the template's rate over its grid's tiles (one
    partial wave), a softmax by its bytes, each streaming at its grid's
    share of the bandwidth: worked out here from the H100's
    figures, not through ``compiler/cost.py``."""
    h100 = Target.named("h100-sxm")
    a, b = (torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(128, 96, dtype=torch.bfloat16))
    ((_, gemm),) = gpu_kernels(torch.mm, a, b, options=Options(matmul="triton"))
    assert gemm.template == "gemm"
    tiles = math.prod(gemm.launch.grid)
    assert 1 <= tiles < h100.sm_count
    share = tiles / h100.sm_count  # idle SMs in the one wave, for FLOPs and bytes
    rate = 800e12 * 0.85 * share
    nbytes = gemm.bytes_read + gemm.bytes_written
    expected = max(gemm.flops / rate, nbytes / 3.0e12 / share) + 2.5e-6
    assert gpu_check.predicted_seconds(gemm) == pytest.approx(expected, rel=1e-12)
    ((_, softmax),) = gpu_kernels(lambda x: torch.softmax(x, -1), torch.randn(8, 100))
    nbytes = softmax.bytes_read + softmax.bytes_written
    share = min(1, math.prod(softmax.launch.grid) / h100.sm_count)
    expected = max(nbytes / 3.0e12 / share, softmax.flops / 67e12) + 2.5e-6
    assert gpu_check.predicted_seconds(softmax) == pytest.approx(expected, rel=1e-12)


def test_zoo_gemms_are_the_linear_layers():
    # The tiny MLP: Linear 32->64, 64->64, 64->10 at batch 1.
    assert model_gemms("mlp", "tiny", "float32") == [
        Gemm(1, 64, 32, "float32"),
        Gemm(1, 64, 64, "float32"),
        Gemm(1, 10, 64, "float32"),
    ]
    rows, failed = zoo_gemms("tiny", "bf16", 5)
    assert not failed and len(rows) == 5
    shapes = [(r["m"], r["n"], r["k"]) for r in rows]
    assert len(set(shapes)) == 5
    # Taken in rounds: the first is the first model's costliest GEMM.
    assert rows[0]["models"][0] == "mlp" and shapes[0] == (1, 64, 64)


def test_a_captured_launch_recomputes_its_kernel_alone():
    before = set(tilec.programs())
    compiled = torch.compile(lambda x: torch.softmax(x * 2, -1), backend="tilec", dynamic=False)
    x = torch.randn(4, 32)
    compiled(x)
    (program,) = [p for name, p in tilec.programs().items() if name not in before]
    launchers = {step.var: program.eager.namespace[step.var] for step in program.launches()}
    captured = capture_launches(program, lambda: program(x))
    ((launcher, args),) = captured.values()
    out = args[-1]
    out.zero_()
    timing = time_launch(launcher, args, "cpu", runs=2, warmup=0, most_sets=2)
    torch.testing.assert_close(out, torch.softmax(x * 2, -1))
    assert timing["input_sets"] == 2 and len(timing["times_s"]) == 2
    # The program's own launchers are back in place.
    assert all(program.eager.namespace[var] is fn for var, fn in launchers.items())


def test_a_section_past_its_time_is_killed_and_says_so(monkeypatch):
    monkeypatch.setattr(gpu_check, "GRACE_S", 0)
    args = gpu_check.parse(["--dry-run"])
    result = gpu_check.run_section("tests", gpu_check.config(args), budget=1)
    assert result["status"] == "timeout" and "killed after 1 s" in result["error"]
    assert "log_tail" in result and result["budget_s"] == 1


def test_a_failing_section_records_its_traceback():
    # A config without the launch section's settings: the section raises.
    cfg = {"device": "cpu", "dry_run": True, "sections": {}}
    result = gpu_check.run_section("launch", cfg, budget=60)
    assert result["status"] == "error" and "KeyError: 'chain'" in result["error"]
    report = {
        "device": "x",
        "dry_run": True,
        "torch": "t",
        "triton": "t",
        "date": "d",
        "command": "c",
        "budget_s": 60,
        "config": {"size": "tiny", "dtype": "float32", "runs": 1, "warmup": 0},
        "sections": {"launch": result},
    }
    text = markdown(report)
    assert "status: error" in text and "KeyError: 'chain'" in text


class _Pytest:
    """What ``subprocess.Popen`` gives the ``tests`` section: a finished pytest."""

    def __init__(self, output: str, returncode: int):
        self.output, self.returncode, self.pid = output, returncode, 0

    def communicate(self, timeout: float) -> tuple[str, None]:
        return self.output, None


COLLECTION_ERROR = """collected 1216 items / 1 error / 1206 deselected / 10 selected
ERROR tests/test_opinfo.py
!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
"""


@pytest.mark.parametrize(
    ("output", "returncode", "ran"),
    [
        ("tests/test_gpu.py::test_a PASSED\n", 0, True),
        ("tests/test_gpu.py::test_a FAILED\nFAILED tests/test_gpu.py::test_a\n", 1, True),
        (COLLECTION_ERROR, 2, False),
        ("no tests ran\n", 5, False),
    ],
)
def test_the_tests_section_fails_when_the_tier_did_not_run(
    monkeypatch, tmp_path, output, returncode, ran
):
    """A file that does not import stops pytest before any test (the first GPU
    run: exit 2, 0 tests, reported as ok); the section says so as an error."""
    monkeypatch.setattr(
        gpu_sections.subprocess, "Popen", lambda *a, **k: _Pytest(output, returncode)
    )
    section = Section({"device": "cpu", "deadline": time.time() + 60}, tmp_path / "r.json")
    if ran:
        gpu_sections.tests(section)
        assert section.data["exit_code"] == returncode
    else:
        with pytest.raises(RuntimeError, match=f"pytest exited with {returncode}"):
            gpu_sections.tests(section)


# The dry run's budget here: every section's share several times what it
# needs alone (the whole run takes about 110 s on this project's 2-core
# machine), so that a loaded machine cannot cut an item short.  CI runs two
# suites side by side, four workers on two cores: with 500 s, the zoo's
# measurement subprocess once ran out of its share and decode skipped an item.
DRY_RUN_TEST_BUDGET_S = 2400


@pytest.mark.slow
def test_dry_run_writes_every_section_with_sane_values(tmp_path):
    budget = str(DRY_RUN_TEST_BUDGET_S)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--budget", budget]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["dry_run"] is True and report["device_kind"] == "cpu"
    assert (report["torch"], report["triton"]) == (torch.__version__, triton.__version__)
    assert report["command"].startswith("python -m benchmarks.gpu_check --dry-run")
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SHARES) == list(gpu_sections.SECTIONS)
    for name, s in sections.items():
        assert s["status"] == "ok", (name, s.get("error"), s.get("log_tail"))
        assert 0 < s["seconds"] <= s["budget_s"] + gpu_check.GRACE_S
    runs = report["config"]["runs"]

    tests = sections["tests"]  # no CUDA: every gpu test is skipped, none fails
    assert tests["counts"]["skipped"] >= 1 and tests["counts"]["failed"] == 0
    # Only the files that mark gpu tests are collected; these do.
    for name in ("test_gpu.py", "test_autotune.py", "test_cudagraphs.py", "test_generate.py"):
        assert f"tests/{name}" in tests["command"].split(), tests["command"]
    assert "tests/test_opinfo.py" not in tests["command"]
    assert tests["counts"]["passed"] == 0 and tests["failed"] == []

    ceilings = sections["ceilings"]
    assert ceilings["bandwidth_bytes_per_s"] > 0 and ceilings["bf16_flops_per_s"] > 0

    gemms = sections["gemms"]["rows"]
    gemm_cfg = report["config"]["sections"]["gemms"]
    assert len(gemms) == len(gemm_cfg["decode"]) + gemm_cfg["shapes"]
    # The decode products first, F.linear against an [N, K] weight.
    decode = [g for g in gemms if g.get("linear")]
    assert [[g["m"], g["n"], g["k"]] for g in decode] == gemm_cfg["decode"]
    assert gemms[: len(decode)] == decode
    for g in gemms:
        assert "error" not in g, g
        assert len(g["library"]["times_s"]) == len(g["template"]["times_s"]) == runs
        assert g["template_tflops"] > 0 and g["library_tflops"] > 0
        assert g["template_predicted_s"] > 0
        assert g["template_rel_error"] < 1e-5  # float32 in the dry run
        ratio = g["library"]["median_s"] / g["template"]["median_s"]
        assert math.isclose(g["template_vs_library"], ratio)

    # The one-row products also as sum reductions (gemv_reduction), timed alone.
    assert [g for g in gemms if "reduction" in g] == decode
    for g in decode:
        assert len(g["reduction"]["times_s"]) == runs and g["reduction_predicted_s"] > 0
        assert g["reduction_rel_error"] < 1e-5 and "RBLOCK" in g["reduction_launch"]
    assert "The one-row products as sum reductions" in markdown(report)

    # The decode products' template relaunched with each variant tile.
    varied = [g for g in gemms if "variants" in g]
    assert sorted(f"{g['m']}x{g['n']}x{g['k']}" for g in varied) == sorted(gemm_cfg["variants"])
    for g in varied:
        wanted = gemm_cfg["variants"][f"{g['m']}x{g['n']}x{g['k']}"]
        assert [v["config"] for v in g["variants"]] == wanted
        for v in g["variants"]:
            assert "error" not in v, v
            assert v["median_s"] > 0 and v["steps"] == g["k"] // v["config"][1]
            assert v["max_abs_diff"] < 1e-4  # float32 in the dry run, another summation order
    launch = sections["launch"]
    rows = [
        (r["graphs"], r["direct"], r["chain"], r["launches"], r["kernels"]) for r in launch["rows"]
    ]
    assert rows == [
        (False, False, False, 2, 2),
        (False, False, False, 8, 8),
        (False, True, False, 2, 2),
        (False, True, False, 8, 8),
        (True, False, False, 2, 2),
        (True, False, False, 8, 8),
        (True, False, True, 1, 2),
        (True, False, True, 1, 8),
    ]  # a multiply and an add per op, one kernel each, or one stage each of one kernel
    # The chained kernel's results are the JIT's, replayed with its counters reset.
    assert all(r["equal_to_jit"] for r in launch["rows"] if r["chain"])
    assert math.isfinite(launch["chain_graph_us_per_stage"])
    # The interpreter compiles nothing to launch directly: JIT launches,
    # the same results.
    direct = [r for r in launch["rows"] if r["direct"]]
    assert all(r["equal_to_jit"] and r["launch_counts"]["jit"] > 0 for r in direct)
    assert all(r["capture"].startswith("captured") for r in launch["rows"] if r["graphs"])
    # On the CPU the stand-in replays (on a GPU the section insists on a CUDA graph).
    assert {r["replayed_by"] for r in launch["rows"] if r["graphs"]} == {"RecordedGraph"}
    assert launch["jit_us_per_launch"] > 0 and math.isfinite(launch["graph_us_per_launch"])
    assert math.isfinite(launch["direct_us_per_launch"])
    # Programmatic dependent launch needs a GPU of compute capability 9.0+.
    assert "pdl_graph_us_per_launch" not in launch and "capability 9.0" in launch["pdl_skipped"]
    text = markdown(report)
    assert "graph replay with programmatic dependent launch: not measured (no GPU" in text
    assert "per stage of a chained kernel, graph replay" in text

    step = sections["decode_step"]
    settings = [
        (r["scheme"], r["pdl"], r["split_combine"], r["gemv_reduction"]) for r in step["rows"]
    ]
    assert settings == [("bf16", False, False, True), ("int4", False, False, True)]
    for r in step["rows"]:
        assert "error" not in r, r.get("error")
        assert r["capture"].startswith("captured") and r["argmax_equal_to_eager"]
        assert r["launches"] > 0 and r["launched_with_pdl"] == 0
        assert r["predicted_s"] > r["limit_s"] > 0 and r["call"]["median_s"] > 0
        assert math.isclose(r["measured_over_predicted"], r["call"]["median_s"] / r["predicted_s"])
        # Every launch of the step timed alone, beside its prediction.
        kernels = r["kernels"]
        assert len(kernels) == r["launches"]
        assert all(k["measured_s"] > 0 and k["predicted_s"] > 0 for k in kernels)
        assert kernels == sorted(kernels, key=lambda k: -k["measured_s"])
        kinds = r["by_template"].values()
        assert sum(v["launches"] for v in kinds) == r["launches"]
        assert math.isclose(
            sum(v["measured_s"] for v in kinds), sum(k["measured_s"] for k in kernels)
        )
    keys = {"bf16/bf16 pdl=False gemv_reduction", "int4/bf16 pdl=False gemv_reduction"}
    assert set(step["ratios"]) == keys
    assert "## 9. The static decode report's step, measured" in text
    assert "The bf16 row's costliest launches" in text
    assert "relaunched with other 16-row tiles" in text

    # Decode attention split into each of the config's chunk counts, the
    # split kernel timed alone: more chunks, more programs, fewer key blocks.
    attention = sections["attention"]
    att_cfg = report["config"]["sections"]["attention"]
    decode = attention["decode"]
    assert [r["chunks"] for r in decode] == att_cfg["decode_chunks"]  # one dry shape
    for r in decode:
        assert "error" not in r, r["error"]
        assert r["split"]["median_s"] > 0 and r["predicted_s"] > 0 and r["max_error"] < 1e-5
    blocks = {r["chunks"]: (math.prod(r["launch"]["grid"]), r["key_blocks"]) for r in decode}
    # 256 keys, blocks of 128; a program per key/value head (2 query heads each)
    assert blocks[1] == (2, 2) and blocks[2] == (4, 1)
    assert "Decode: one query row of grouped-query attention" in text

    kernels = sections["kernels"]
    rows = kernels["models"]["mlp"]["kernels"]
    assert rows and kernels["summary"]["kernels"] == len(rows)
    for k in rows:
        assert k["measured_s"] > 0 and k["predicted_s"] > 0 and len(k["times_s"]) == runs
        assert math.isclose(k["measured_over_predicted"], k["measured_s"] / k["predicted_s"])
    assert math.isfinite(kernels["summary"]["median_abs_log_error"])

    zoo = sections["zoo"]
    assert [r["backend"] for r in zoo["results"]] == ["eager", "tilec", "tilec:reduce-overhead"]
    for r in zoo["results"]:
        assert "error" not in r, r
        assert r["accurate"] and len(r["times_s"]) == runs and r["median_s"] > 0
    assert {s["backend"] for s in zoo["skipped"]} == {"inductor", "inductor:reduce-overhead"}

    decode = sections["decode"]
    assert [r["backend"] for r in decode["results"]] == ["eager", "tilec", "tilec:reduce-overhead"]
    for r in decode["results"]:
        assert r["same_tokens"] and r["tokens_per_s"] > 0
    assert all(r["programs"] == 2 for r in decode["results"][1:])  # prompt, then decode steps

    text = (tmp_path / "results.md").read_text()
    assert "DRY RUN ON A CPU" in text and "say nothing about GPU speed" in text
    for title in TITLES.values():
        assert f"## {title}" in text


def test_unknown_sections_and_models_and_no_gpu_are_refused():
    with pytest.raises(SystemExit, match="unknown"):
        gpu_check.parse(["--dry-run", "--sections", "tests,speed"])
    with pytest.raises(SystemExit, match="unknown"):
        gpu_check.parse(["--dry-run", "--models", "gpt5"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--dry-run"):
            gpu_check.parse([])


def test_attention_backward_measurement_runs_where_flex_takes_gradients(tmp_path, monkeypatch):
    """The attention section's backward measurement, run on the CPU with
    FlexAttention's CPU refusal lifted (on a GPU there is none): both
    backward kernels timed, SDPA's backward beside them, gradients close to
    float32 SDPA's.  Without the lift it says why it skipped."""
    import torch.nn.attention.flex_attention as flex_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from benchmarks import gpu_attention
    from benchmarks.gpu_timing import Section

    section = Section({"device": "cpu", "runs": 2, "warmup": 1}, tmp_path / "r.json")
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    mask = create_block_mask(gpu_attention._causal, None, None, 64, 64, device="cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=mask)

    skipped = gpu_attention._backward(section, fn, q, k, v, forward_s=0.0)
    assert "backward on CPU" in skipped["skipped"]
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    result = gpu_attention._backward(section, fn, q, k, v, forward_s=0.0)
    assert len(result["kernels"]) == 2, result
    assert result["template_s"] > 0 and result["predicted_s"] > 0
    assert max(result["max_error"]) < 1e-4, result["max_error"]
    torch._dynamo.reset()
    gc.collect()  # training's programs sit in reference cycles: free them for later tests
