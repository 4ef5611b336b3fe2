"""The model-zoo harness in CPU check mode, and its accuracy rule and reports."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import tilec
from benchmarks import decode, dynamic, overhead, quant, roofline, run, static
from benchmarks.measure import accuracy, measure
from benchmarks.report import geomean, markdown_table
from benchmarks.zoo import MODELS
from tests.lowering import gpu_kernels


def test_zoo_has_the_models_the_benchmark_promises():
    assert len(MODELS) >= 12
    for name in ("mlp", "resnet18", "resnet50", "gpt2", "llama", "bert", "t5", "with_fallbacks"):
        assert name in MODELS


def test_accuracy_rule_compares_with_eager_error():
    ref = torch.linspace(-1, 1, 100, dtype=torch.float64)
    eager = (ref + 1e-6).float()
    assert accuracy(eager + 1e-6, eager, ref)["accurate"]  # 2x eager's error
    assert not accuracy(eager + 1e-4, eager, ref)["accurate"]  # 100x
    exact = ref.float().double()
    assert accuracy(exact.float(), exact.float(), exact)["accurate"]  # floor when eager is exact


def test_geomean():
    assert abs(geomean([2.0, 8.0]) - 4.0) < 1e-12 and geomean([]) is None


def test_check_mode_runs_models_through_every_backend(tmp_path, capsys):
    # Two light models (Inductor's CPU code for GPT-2 took most of a minute
    # to build): one all kernels, one with fallbacks.
    models = "mlp,with_fallbacks"
    assert run.main(["--check", "--models", models, "--out", str(tmp_path)]) == 0
    printed, progress = capsys.readouterr()
    assert "check: all passed" in printed
    # A line on stderr as each of the 6 measurements starts and as it ends.
    lines = [line for line in progress.splitlines() if line.startswith("[")]
    assert len(lines) == 12 and lines[0].startswith("[1/6 ") and "mlp tilec inference" in progress
    assert lines[-1].startswith("[6/6 ") and lines[-1].endswith("s") and "accurate" in lines[-1]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["device_kind"] == "cpu" and report["torch"] == torch.__version__
    results = report["results"]
    assert {(r["model"], r["backend"]) for r in results} == {
        (m, b) for m in models.split(",") for b in ("eager", "inductor", "tilec")
    }
    for r in results:
        assert "error" not in r, r
        assert r["accurate"] and len(r["times_s"]) == r["runs"] and r["median_s"] > 0
        assert r["timing"].startswith("CPU")
    tilec = {r["model"]: r for r in results if r["backend"] == "tilec"}
    assert tilec["mlp"]["kernels"] > 0 and tilec["mlp"]["fallbacks"] == 0
    assert tilec["with_fallbacks"]["fallbacks"] >= 2  # topk, sort (tiny: cumsum lowers)
    table = (tmp_path / "results.md").read_text()
    assert table == markdown_table(report) and "| mlp | inference | float32 |" in table
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"


def test_every_benchmark_flag_says_what_it_does(monkeypatch):
    parsers = []

    def stop(parser, *args, **kwargs):
        parsers.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    for tool in (run, decode, dynamic, overhead, quant, static):
        with pytest.raises(SystemExit):
            tool.main([])
    assert len(parsers) == 6
    for parser in parsers:
        for action in parser._actions:
            assert action.help, f"{parser.prog} {action.option_strings} has no help"
    (_, _, dynamic_parser, *_) = parsers
    backends = next(a for a in dynamic_parser._actions if a.dest == "backends")
    assert "tilec:first (specialize='first'" in backends.help
    assert "specialize='first' and max_specializations=N" in backends.help


def test_kernel_traffic_and_work_from_codegen():
    # softmax over (8, 100) float32: read and write every element once; max,
    # sub, exp, sum and div at each of the 800 points.
    ((_, softmax),) = gpu_kernels(lambda x: torch.softmax(x, -1), torch.randn(8, 100))
    assert (softmax.bytes_read, softmax.bytes_written, softmax.flops) == (3200, 3200, 4000)
    # A gather touches only the rows it reads: 32 ids (int64) and 32 rows of 16.
    ((_, gather),) = gpu_kernels(
        lambda t, i: F.embedding(i, t), torch.randn(1000, 16), torch.randint(0, 1000, (4, 8))
    )
    assert gather.bytes_read == 32 * 8 + 32 * 16 * 4 and gather.bytes_written == 32 * 16 * 4


def test_roofline_report_lists_every_kernel_by_time(capsys):
    assert roofline.main(["--model", "mlp", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    kernels = [line for line in out.splitlines() if ":tilec_k" in line]
    assert len(kernels) == tilec.stats()["kernels"] > 0
    times = [float(line.split()[-1]) for line in kernels]
    assert times == sorted(times, reverse=True) and all(t > 0 for t in times)
    assert "interpreter times" in out


def _spec(backend: str, mode: str = "inference") -> dict:
    return {
        "model": "mlp",
        "backend": backend,
        "device": "cpu",
        "dtype": "float32",
        "mode": mode,
        "size": "tiny",
        "batch": 2,
        "rotations": 1,
        "warmup": 0,
        "runs": 1,
    }


def test_frozen_tilec_is_a_backend_of_the_harness():
    result = measure(_spec("tilec+freeze"))
    assert result["accurate"] and result["kernels"] > 0 and result["fallbacks"] == 0


def test_a_measurement_leaves_no_cache_folders_and_restores_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = {var: os.environ.get(var) for var in ("TILEC_CACHE_DIR", "TRITON_CACHE_DIR")}
    result = measure(_spec("tilec"))
    assert result["accurate"] and result["kernels"] > 0
    assert list(tmp_path.iterdir()) == []
    assert {var: os.environ.get(var) for var in before} == before


def test_freezing_for_training_is_refused_by_name():
    with pytest.raises(ValueError, match="freeze is for inference"):
        measure(_spec("tilec+freeze", "training"))
    with pytest.raises(ValueError, match="unknown backend"):
        measure(_spec("tilec+fast"))


def test_dynamic_shapes_benchmark_counts_programs_and_checks_results(tmp_path, capsys):
    out = tmp_path / "dynamic.json"
    backends = "eager,tilec:1,tilec"
    argv = ["--lengths", "5,7,9", "--backends", backends, "--runs", "1", "--json", str(out)]
    assert dynamic.main(argv) == 0
    assert "tilec:1" in capsys.readouterr().out
    eager, tilec_row, hot = json.loads(out.read_text())["results"]
    # One specialized program for the first length, one generic for the others.
    assert tilec_row["programs_first_pass"] == tilec_row["programs"] == 2
    assert not tilec_row["fallbacks"]
    assert tilec_row["max_error"] < 1e-4 and eager["max_error"] == 0
    assert sorted(map(int, tilec_row["median_ms"])) == [5, 7, 9]
    # Hot sizes: one pass over new lengths compiles only the generic program;
    # each length is specialized on its third call (the warm-up and one timed
    # call after the first pass), so all three end up with their own.
    assert (hot["programs_first_pass"], hot["programs"]) == (1, 4)
    assert hot["max_error"] < 1e-4 and not hot["fallbacks"]


def test_decode_benchmark_check_mode_generates_eagers_tokens_without_fallbacks(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert decode.main(["--check", "--caches", "static", "--json", str(out)]) == 0
    printed, progress = capsys.readouterr()
    assert "tokens/s" in printed
    # Progress on stderr (where transformers may warn too).
    assert "\n[4/4 " in progress and "gpt2 static tilec" in progress
    report = json.loads(out.read_text())
    rows = {(r["model"], r["backend"]): r for r in report["results"]}
    assert set(rows) == {(m, b) for m in ("llama", "gpt2") for b in ("eager", "tilec")}
    for model in ("llama", "gpt2"):
        row = rows[(model, "tilec")]
        assert row["same_tokens"] and row["fallbacks"] == {}
        # The static cache: one program for the prompt, one for every decode step.
        assert row["programs"] == 2
        assert len(row["tokens"][0]) == report["new_tokens"] and row["tokens_per_s"] > 0


def test_decode_backend_names_become_compile_arguments(monkeypatch):
    """``tilec:direct`` is tilec with the option ``direct_launch``,
    ``tilec:reduce-overhead-pdl`` tilec with ``cudagraphs`` and ``pdl``
    (torch.compile refuses a mode and options together, which the fake
    below checks); another name after the colon is torch.compile's mode."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    model = torch.nn.Linear(2, 2)
    for backend in (
        "tilec:direct",
        "tilec:reduce-overhead",
        "tilec:reduce-overhead-pdl",
        "inductor",
    ):
        decode._compile(model, backend, "static")
    assert [(k["backend"], k["mode"], k["options"]) for k in seen] == [
        ("tilec", None, {"direct_launch": True}),
        ("tilec", "reduce-overhead", None),
        ("tilec", None, {"cudagraphs": True, "pdl": True}),
        ("inductor", None, None),
    ]
    assert all(k["fullgraph"] for k in seen)


def test_quant_benchmark_check_mode_measures_bytes_and_errors_per_scheme(tmp_path, capsys):
    out = tmp_path / "quant.json"
    assert quant.main(["--check", "--json", str(out)]) == 0
    printed, progress = capsys.readouterr()
    assert "RMSE fp64" in printed
    assert "\n[10/10 " in progress and "llama int8_weight_only" in progress
    report = json.loads(out.read_text())
    rows = {(r["model"], r["scheme"]): r for r in report["results"]}
    schemes = ["none", "int8_weight_only", *(f"int4_weight_only:{g}" for g in (32, 64, 128))]
    assert set(rows) == {(m, s) for m in ("gpt2", "llama") for s in schemes}
    assert {(s["model"], s["scheme"]) for s in report["skipped"]} == {
        ("gpt2", "fp8"),
        ("llama", "fp8"),
    }
    assert all("not available on this target" in s["reason"] for s in report["skipped"])
    for model in ("gpt2", "llama"):
        plain, int8, int4 = (rows[(model, s)] for s in schemes[:3])
        assert (
            plain["bytes_ratio"] == 1 and plain["rmse_float"] == 0 and plain["top1_agreement"] == 1
        )
        assert plain["rmse_fp64"] < 1e-6
        # The head stays float: one layer skipped.
        assert int8["layers_skipped"] == 1 and int8["bytes_ratio"] < 0.35
        assert 0 < int8["rmse_float"] < int4["rmse_float"] < 0.1
    # Every GPT-2 layer but the head has input features a multiple of 32: int4
    # takes less than int8 (tiny LLaMA's down_proj, 176 features, stays float).
    assert rows[("gpt2", schemes[2])]["bytes_ratio"] < rows[("gpt2", schemes[1])]["bytes_ratio"]
    # Tiny LLaMA, int8: each projection N*K bytes and 4*N of scales, the
    # float32 head (128 x 64) as it was.
    projections = [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176)]
    layer = sum(n * k + 4 * n for n, k in projections)
    assert rows[("llama", "int8_weight_only")]["linear_weight_bytes"] == 2 * layer + 128 * 64 * 4
    # No tiny LLaMA layer has input features a multiple of 128: nothing quantized.
    assert rows[("llama", "int4_weight_only:128")]["layers_quantized"] == 0
    assert rows[("llama", "int4_weight_only:128")]["bytes_ratio"] == 1


def test_the_table_survives_a_run_that_failed_first():
    """A report whose first result is an error (no timing) still renders."""
    common = {"model": "mlp", "mode": "inference", "dtype": "float32", "source": "zoo"}
    report = {
        "device": "cpu",
        "device_kind": "cpu",
        "torch": torch.__version__,
        "triton": "-",
        "date": "2026-11-26",
        "command": "python -m benchmarks.run",
        "accuracy_rule": "-",
        "results": [
            {**common, "backend": "tilec", "error": "RuntimeError: boom"},
            {**common, "backend": "eager", "timing": "CPU wall clock", "median_s": 0.002},
        ],
    }
    table = markdown_table(report)
    assert "ms, CPU wall clock" in table and "| error |" in table
