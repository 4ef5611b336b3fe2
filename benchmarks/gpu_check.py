"""The one GPU command: what a GPU machine can tell about tilec, in one run.

    python -m benchmarks.gpu_check [--out DIR] [--budget S] [--sections a,b] [--models a,b]
    python -m benchmarks.gpu_check --dry-run --out DIR       # the same path on a CPU

Sections (``benchmarks/gpu_sections.py``, ``benchmarks/gpu_kernels.py``), in this order:

1. ``tests``: the ``gpu`` test tier (``pytest -m gpu``): counts, failures' names.
2. ``ceilings``: copy bandwidth and bf16 matmul FLOP/s (``roofline.measure_peaks``).
3. ``gemms``: cuBLAS against tilec's Triton GEMM template at the zoo's GEMM shapes.
4. ``launch``: host cost per kernel launch: program calls through Triton's JIT and
   through the direct launcher, against CUDA graph replay, with and without
   programmatic dependent launch (the option ``pdl``).
5. ``kernels``: each zoo model's costliest kernels timed alone, against
   :func:`predicted_seconds`.
6. ``zoo``: eager, Inductor and tilec (with and without ``reduce-overhead``) on
   the zoo at batch 1 (``benchmarks/run.py``'s measurement).
7. ``decode``: greedy decoding tokens/s (``benchmarks/decode.py``).
8. ``attention``: decode attention split into chunks (the time of a key
   block, which the cost model assumes), then tilec's attention template
   against torch's SDPA, forward and backward
   (``benchmarks/gpu_attention.py``).
9. ``decode_step``: the static decode report's step (TinyLlama's shape, a
   2048-position static cache; bf16, int4 and int8 weights, with and without
   ``pdl``) measured under ``reduce-overhead`` against its prediction
   (``benchmarks/gpu_decode.py``).

Each section runs in a process of its own (a CUDA error or a hang costs one
section) with a share of ``--budget`` (default 480 s, so that the whole
fits one 10-minute command of a 15-minute lease; time a section leaves is shared among the
ones after it); past its share plus a grace it is killed and what it had
saved is kept.  A failing section records its traceback and the others run.
Timing: CUDA events after warm-up, median of many runs, inputs rotated
(``benchmarks/gpu_timing.py``).  After every section ``results.json`` (device,
versions, date, command, config, every raw number) and ``results.md`` are
written under ``--out`` (default ``benchmarks/results/gpu/<date>-<device>``).

``--dry-run`` runs the same sections on the CPU: tiny models and shapes,
float32 (the Triton interpreter has no bf16 dot), few runs, kernels in the
interpreter, CUDA graphs through the runtime's CPU stand-in, Inductor left
out.  Its numbers are CPU numbers and say nothing about GPU speed; the files
say so.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import decode, run, static, static_decode
from benchmarks.gpu_report import markdown
from benchmarks.zoo import MODELS
from tilec.codegen.kernel import KernelSource

ROOT = Path(__file__).resolve().parent.parent

# Section -> its share of the default budget, in seconds.  The default (480 s)
# fits one command of a 15-minute GPU lease, the machine's start and the
# install included; the first run (470 s, on an H200) ran the tests in 69 s,
# the ceilings in 9, the GEMMs in 31 and launches in 16, and left the
# kernels, zoo and decode sections partial.  The test tier alone took 73 s
# of pytest on an H100 (third run), past a 75 s share.  The launch section
# took 15 s of 20 on an H100 before it timed the direct launcher as well
# (half as many programs again): 30 s, from the kernels' share.  The
# decode step against its prediction (what issue 23's figures rest on) took
# 80 s from the kernels' (30), the zoo's (30), decode's (10) and attention's
# (10) shares, which earlier runs have measured.  Its first GPU run (fourth
# run, H200) got through one row of nine in 82 s (a compile of the 22-layer
# step is most of a row): 60 s more, from the zoo's, decode's and
# attention's shares (20 each), which earlier runs measured.  The GEMMs'
# template variants at two decode products (16 launches, each compiled):
# 30 s more, from the same three (10 each); two more, the heuristic's
# stages at q/k/v and gate/up, about 4 s, within it.
SHARES = {
    "tests": 100,
    "ceilings": 15,
    "gemms": 65,
    "launch": 30,
    "kernels": 40,
    "zoo": 30,
    "decode": 30,
    # Forward and backward per shape (the backward added 20 s).
    "attention": 30,
    "decode_step": 140,
}
# Seconds a section may run past its share (starting up, finishing an item)
# before it is killed.
GRACE_S = 20
# A section given fewer seconds than this is skipped.
MIN_SECTION_S = 5
DRY_RUN_BUDGET = 600

# Model lists, most wanted first: the budget decides how far a run gets.
KERNEL_MODELS = (
    "gpt2,resnet50,llama,bert,vit_b16,convnext_t,t5,mobilenet_v3,unet_block,resnet18,mlp,"
    "with_fallbacks"
)
ZOO_MODELS = "gpt2,resnet50,llama"
DECODE_MODELS = "gpt2,llama"
BACKENDS = ["eager", "tilec", "tilec:reduce-overhead", "inductor", "inductor:reduce-overhead"]
# Decode also without CUDA graphs through the direct launcher (not in the
# dry run: on a CPU it is ``tilec`` again).  Programmatic dependent launch
# is measured by the ``decode_step`` section, on a step of realistic size.
GPU_ONLY_BACKENDS = ("tilec:direct",)
DECODE_BACKENDS = [
    "tilec",
    "tilec:direct",
    "tilec:reduce-overhead",
    "inductor",
    "inductor:reduce-overhead",
]


# The dry run's decode step: a LLaMA of one tiny layer with grouped-query
# attention.
DECODE_STEP_DRY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


def predicted_seconds(kernel: KernelSource) -> float:
    """The predicted time of one launch of ``kernel``: the one prediction the
    ``kernels`` section compares measurements with, from tilec's cost model
    (``compiler/cost.py``, through the static report's pricing of a kernel)."""
    return static.kernel_prediction(kernel).seconds


def config(args: argparse.Namespace) -> dict[str, Any]:
    """What every section reads (JSON): shared settings, and each section's own under its name."""
    dry = args.dry_run
    return {
        "dry_run": dry,
        "device": "cpu" if dry else "cuda",
        "size": "tiny" if dry else "full",
        "dtype": "float32" if dry else "bf16",
        "runs": 3 if dry else 50,
        "warmup": 1 if dry else 10,
        "max_input_sets": 2 if dry else 8,
        # A section starts no item with fewer seconds than this left.
        "item_min_s": 1 if dry else 15,
        "sections": {
            "ceilings": {"copy_bytes": 1 << (22 if dry else 28), "matmul_n": 256 if dry else 8192},
            "gemms": {
                "shapes": 3 if dry else 20,
                # TinyLlama's decode products at batch 1 (q/k/v, o, gate/up,
                # down): the K-loop round trips the cost model prices
                # (``round_trip_s``) at the steps codegen now takes.
                "decode": [[1, 64, 64]]
                if dry
                else [[1, 2560, 2048], [1, 2048, 2048], [1, 11264, 2048], [1, 2048, 5632]],
                # Decode products ("MxNxK") whose template is relaunched
                # with each of their variants ([BLOCK_N, BLOCK_K, warps,
                # stages]): whether a 16-row K step's cost
                # (``few_row_step_s``, 0.765 us at 16 x 16 x 512, 8 stages)
                # follows its stages, its width, its warps or its columns;
                # and whether programs sharing an SM overlap their K steps
                # (``gemm.fewest_waves``, which gives q/k/v's 160 tiles 4
                # stages and gate/up's 176 tiles 2, for one wave of two
                # programs an SM): the template's own launch against the
                # heuristic's stages (one program an SM, two waves).
                "variants": {"1x64x64": [[16, 16, 4, 2]]}
                if dry
                else {
                    f"1x2048x{k}": [[16, 512, 4, 2], [16, 512, 4, 4], [16, 256, 4, 8]]
                    + [[16, 128, 4, 8], [16, 512, 2, 8], [16, 512, 8, 8]]
                    + [[32, 512, 4, 6], [64, 512, 8, 4]]
                    for k in (2048, 5632)
                }
                | {"1x2560x2048": [[16, 512, 4, 8]], "1x11264x2048": [[64, 512, 8, 4]]},
            },  # fmt: skip
            "launch": {
                "chain": 4 if dry else 16,
                "calls": 3 if dry else 200,
                "repeats": 3 if dry else 15,
            },
            "kernels": {
                "models": args.kernel_models.split(","),
                "per_model": 3 if dry else 5,
                "profile_calls": 1 if dry else 5,
            },
            "zoo": {"models": args.models.split(","), "backends": BACKENDS, "timeout_s": 240},
            "attention": {
                # (batch, heads, sequence, head dimension)
                "shapes": [[1, 2, 64, 16]]
                if dry
                else [[1, 16, 1024, 64], [8, 16, 1024, 64], [1, 16, 4096, 64], [1, 16, 8192, 128]],
                # Decode rows first (batch, query heads, key heads, keys,
                # head dimension): TinyLlama's step at batch 1, then 8.
                "decode_shapes": [[1, 4, 2, 256, 16]]
                if dry
                else [[1, 32, 4, 2048, 64], [8, 32, 4, 2048, 64]],
                "decode_chunks": [None, 1, 2] if dry else [None, 2, 4, 8, 16, 32],
            },  # fmt: skip
            "decode": {
                "models": args.decode_models.split(","),
                "caches": ["static"] if dry else ["static", "dynamic"],
                "backends": [b for b in DECODE_BACKENDS if not (dry and b in GPU_ONLY_BACKENDS)],
                "prompt": 5 if dry else 16,
                "new_tokens": 3 if dry else 32,
                "runs": 1 if dry else 10,
            },
            "decode_step": {
                "shape": DECODE_STEP_DRY if dry else static_decode.SHAPE,
                "cache": 16 if dry else 2048,
                "batch": 1,
                # (scheme, pdl[, split_combine[, gemv_reduction[, chain]]]), most
                # wanted first (the fourth GPU run had time for one row):
                # bf16 with its GEMVs as templates and as sum reductions
                # (which the template's measured K steps leave the open
                # question), then int4, the other end of issue 23's
                # done-when, both ways; int4 with every kernel between two
                # attentions chained (2 launches a layer: do its logits stay
                # eager's, and what does it change); whether split_combine's logits stay
                # eager's on a GPU, then what pdl changes.  On a CPU pdl
                # changes nothing (no GPU has it there); the dry run's
                # 16-position cache is not split.
                "rows": [["bf16", False, False, True], ["int4", False, False, True]]
                if dry
                else [["bf16", False], ["bf16", False, False, True], ["int4", False]]
                + [["int4", False, False, True], ["int4", False, True, True, True]]
                + [["bf16", False, True], ["int4", False, True], ["bf16", True]]
                + [["int4", True], ["int8", False], ["int8", False, False, True]]
                + [["int8", True], ["int8", False, True]],
                "calls": 1 if dry else 50,
                "repeats": 1 if dry else 10,
                # Steps with every launch timed alone (``gpu_decode.kernel_times``).
                "profile_calls": 1 if dry else 3,
            },
        },
    }


def environment(device: str, argv: list[str]) -> dict[str, Any]:
    env = run.environment(device)
    env["command"] = shlex.join(["python", "-m", "benchmarks.gpu_check", *argv])
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {
            "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "memory_bytes": props.total_memory,
        }
    return env


def run_section(name: str, cfg: dict[str, Any], budget: float) -> dict[str, Any]:
    """Run one section in its own process, its output echoed with its name;
    its result, with ``status`` ``ok``, ``partial`` (items skipped for time),
    ``error`` (it raised), ``timeout`` or ``crashed``."""
    start = time.time()
    own = {k: v for k, v in cfg.items() if k != "sections"} | cfg["sections"].get(name, {})
    with tempfile.TemporaryDirectory(prefix="tilec-gpu-check-") as tmp:
        config_path, result_path = Path(tmp, "config.json"), Path(tmp, "result.json")
        config_path.write_text(json.dumps(own | {"deadline": start + budget}))
        cmd = [sys.executable, "-m", "benchmarks.gpu_sections", name, config_path, result_path]
        # A session of its own: on timeout the whole group goes (pytest's and
        # the zoo's measurement processes too).
        proc = subprocess.Popen(
            list(map(str, cmd)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        tail: collections.deque[str] = collections.deque(maxlen=80)
        echo = threading.Thread(target=_echo, args=(proc.stdout, name, tail), daemon=True)
        echo.start()
        killed = None
        try:
            proc.wait(timeout=budget + GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = f"killed after {budget + GRACE_S:.0f} s (its share: {budget:.0f} s)"
        echo.join(timeout=10)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if killed:
        result.update(status="timeout", error=killed)
    elif "status" not in result:
        result.update(
            status="crashed", error=f"the section's process exited with {proc.returncode}"
        )
    if result["status"] in ("timeout", "crashed"):
        result["log_tail"] = "".join(tail)
    return result | {"seconds": time.time() - start, "budget_s": budget}


def _echo(stream: Any, name: str, tail: collections.deque[str]) -> None:
    for line in stream:
        tail.append(line)
        print(f"[{name}] {line}", end="", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same path on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json/.md")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all sections")
    parser.add_argument("--sections", default=",".join(SHARES), help="comma-separated subset")
    parser.add_argument("--models", default=None, help=f"zoo section (default {ZOO_MODELS})")
    parser.add_argument("--kernel-models", default=None, help="kernels section (default: all)")
    parser.add_argument("--decode-models", default=None, help=f"default {DECODE_MODELS}")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    dry = args.dry_run
    args.models = args.models or ("mlp" if dry else ZOO_MODELS)
    args.kernel_models = args.kernel_models or ("mlp" if dry else KERNEL_MODELS)
    args.decode_models = args.decode_models or ("gpt2" if dry else DECODE_MODELS)
    args.budget = args.budget or (DRY_RUN_BUDGET if dry else sum(SHARES.values()))
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in args.sections if s not in SHARES]
    models = args.models.split(",") + args.kernel_models.split(",")
    unknown += [m for m in models if m not in MODELS]
    unknown += [m for m in args.decode_models.split(",") if m not in decode.DECODERS]
    if unknown:
        raise SystemExit(f"unknown section(s) or model(s) {unknown}: sections {list(SHARES)}")
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry-run")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    cfg = config(args)
    env = environment(cfg["device"], argv)
    slug = (
        "dry-run-cpu"
        if args.dry_run
        else re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    )
    out = args.out or ROOT / "benchmarks" / "results" / "gpu" / f"{env['date'][:10]}-{slug}"
    out.mkdir(parents=True, exist_ok=True)
    report = {"dry_run": args.dry_run, **env, "budget_s": args.budget, "config": cfg}
    report["sections"] = {}
    start = time.time()
    for k, name in enumerate(args.sections):
        # This section's share of the time left, by the shares of those left.
        left = args.budget - (time.time() - start)
        shares = [SHARES[s] for s in args.sections[k:]]
        budget = left * SHARES[name] / sum(shares)
        print(f"== {name}: {budget:.0f} s", flush=True)
        if budget < MIN_SECTION_S:
            result = {"status": "skipped", "error": "no time left", "seconds": 0.0}
            report["sections"][name] = result | {"budget_s": budget}
        else:
            report["sections"][name] = run_section(name, cfg, budget)
        report["seconds"] = time.time() - start
        (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "results.md").write_text(markdown(report))
    failed = [n for n, r in report["sections"].items() if r["status"] not in ("ok", "partial")]
    print(f"wrote {out}/results.json and results.md; sections failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
