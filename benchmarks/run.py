"""The model-zoo benchmark: tilec against Inductor and eager.

    python -m benchmarks.run --check
        CPU check mode: the tiny configurations through eager, Inductor and
        tilec (inference, float32); checks accuracy and kernel counts, prints
        the table; exits 1 when a check fails.
    python -m benchmarks.run --device cuda --dtypes bf16,float32 --modes inference,training \\
            --batch 8 --models gpt2,llama,resnet50 --out benchmarks/results/<name>
        the full-size zoo on a GPU.

Every (model, backend, mode, dtype) is measured in a fresh process
(``benchmarks/measure.py``) with a timeout, so compile times are cold and one
bad model costs one row.  Backends are ``eager``, ``inductor``, ``tilec`` and
``tilec:<mode>`` / ``inductor:<mode>`` for torch.compile modes, and
``tilec+freeze`` / ``inductor+freeze`` for inference with frozen weights.  Output:
``results.json`` (device, versions, date, command, every raw timing),
``results.md`` (the table) and ``speedup.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import triton

from benchmarks.measure import DTYPES, RMSE_FACTOR, RMSE_FLOOR
from benchmarks.progress import Progress
from benchmarks.report import markdown_table, plot_speedups
from benchmarks.zoo import MODELS


def measure_in_subprocess(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One measurement (``benchmarks/measure.py``) in a fresh process: its
    result, or ``spec`` with an ``error`` when it failed or ran past ``timeout``."""
    cmd = [sys.executable, "-m", "benchmarks.measure", json.dumps(spec)]
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {**spec, "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    return {
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or platform.machine(),
        "device_kind": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        # The zoo's and the decode benchmarks' models come from it, and its
        # interfaces change between versions (the KV cache's keyword).
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(
            [os.path.basename(sys.executable), "-m", "benchmarks.run", *sys.argv[1:]]
        ),
        "accuracy_rule": f"RMSE(compiled, fp64) <= max({RMSE_FACTOR} * RMSE(eager, fp64), "
        f"{RMSE_FLOOR} * RMS(fp64))",
    }


def run_zoo(args: argparse.Namespace) -> dict[str, Any]:
    specs = [
        {
            "model": model,
            "backend": backend,
            "device": args.device,
            "dtype": dtype,
            "mode": mode,
            "size": args.size,
            "batch": args.batch,
            "rotations": args.rotations,
            "warmup": args.warmup,
            "runs": args.runs,
        }
        for model in args.models
        for mode in args.modes
        for dtype in args.dtypes
        for backend in args.backends
    ]
    results = []
    progress = Progress(len(specs))
    for spec in specs:
        progress.start(f"{spec['model']} {spec['backend']} {spec['mode']} {spec['dtype']}")
        results.append(measure_in_subprocess(spec, args.timeout))
        progress.end(_outcome(results[-1]))
    return {**environment(args.device), "results": results}


def _outcome(result: dict[str, Any]) -> str:
    """One measurement's result, for its progress line."""
    if "error" in result:
        # Dynamo's wrapper says which backend raised on a line of its own.
        lines = [ln for ln in result["error"].splitlines() if ln.strip()]
        said = [ln for ln in lines if not ln.endswith("raised:")] or lines or [""]
        return "error: " + said[0][:200]
    accurate = "accurate" if result["accurate"] else "INACCURATE"
    return f"{accurate}, median {result['median_s'] * 1000:.3g} ms"


def check_failures(report: dict[str, Any]) -> list[str]:
    """What the CPU check mode insists on: every run compiled and is accurate,
    tilec generated kernels for every model, and the fallback model fell back."""
    problems = []
    for r in report["results"]:
        name = f"{r['model']} {r['backend']} {r['mode']} {r['dtype']}"
        if "error" in r:
            problems.append(f"{name}: {r['error'].splitlines()[0]}")
            continue
        if not r["accurate"]:
            problems.append(
                f"{name}: inaccurate, RMSE {r['rmse']:.3g} vs eager {r['rmse_eager']:.3g}"
            )
        if r["backend"].startswith("tilec"):
            if not r["kernels"]:
                problems.append(f"{name}: no Triton kernels")
            if r["model"] == "with_fallbacks" and not r["fallbacks"]:
                problems.append(f"{name}: expected ATen fallbacks, saw none")
    return problems


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="CPU check mode: tiny models on the CPU (overrides --device and --size); checks "
        "that every run compiles and is accurate, that tilec generates kernels and that the "
        "with_fallbacks model falls back; exit status 1 when a check fails",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda when a GPU is available, else cpu)",
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated zoo models (default: all of them: {', '.join(MODELS)})",
    )
    parser.add_argument(
        "--backends",
        default="eager,inductor,tilec",
        help="comma-separated backends (default: %(default)s): eager, inductor or tilec, "
        "optionally followed by +freeze (inference only: weights frozen into constants, "
        "tilec's options={'freeze': True}, Inductor's freezing) and by :MODE, the "
        "torch.compile mode (default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs), e.g. tilec:reduce-overhead or tilec+freeze:max-autotune",
    )
    parser.add_argument(
        "--modes",
        default="inference",
        help="comma-separated: inference (under no_grad) and/or training (forward, loss, "
        "backward and an SGD step) (default: %(default)s)",
    )
    parser.add_argument(
        "--dtypes",
        default="float32",
        help=f"comma-separated: {', '.join(DTYPES)} (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        choices=("tiny", "full"),
        default=None,
        help="model configurations: tiny (runs in the Triton interpreter) or full "
        "(default: full on cuda, tiny on cpu; --check: tiny)",
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="batch size (default: 8 full, 2 tiny)"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="timed calls per measurement; the median is reported (default: 50 full, 3 tiny)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls after the first, compiling, call (default: 10 full, 1 tiny)",
    )
    parser.add_argument(
        "--rotations",
        type=int,
        default=4,
        help="input sets the timed calls take in turn, so caches do not flatter "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds one measurement's process may take; past it the row is an error "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory to write results.json, results.md and speedup.png to "
        "(default: none; the table is printed either way)",
    )
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    for field in ("models", "backends", "modes", "dtypes"):
        setattr(args, field, [v for v in getattr(args, field).split(",") if v])
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; the zoo has {sorted(MODELS)}")
    bad = [d for d in args.dtypes if d not in DTYPES] + [
        m for m in args.modes if m not in ("inference", "training")
    ]
    if bad:
        raise SystemExit(f"unknown dtype/mode {bad}")
    if args.check:
        args.device, args.size = "cpu", "tiny"
    tiny = (args.size or ("full" if args.device == "cuda" else "tiny")) == "tiny"
    args.size = "tiny" if tiny else "full"
    args.batch = args.batch or (2 if tiny else 8)
    args.runs = args.runs or (3 if tiny else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = run_zoo(args)
    table = markdown_table(report)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
        (args.out / "results.md").write_text(table)
        plot_speedups(report, args.out / "speedup.png")
        print(f"wrote {args.out}/results.json, results.md, speedup.png")
    if args.check:
        problems = check_failures(report)
        print("check: " + ("all passed" if not problems else f"{len(problems)} problem(s)"))
        for p in problems:
            print("  " + p)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
