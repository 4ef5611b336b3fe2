"""Shapes that change on every call: compilations, time and accuracy.

    python -m benchmarks.dynamic [--model gpt2] [--size tiny|full]
        [--lengths 8,12,...] [--backends eager,inductor,tilec,tilec:first,tilec:4,tilec:0]
        [--runs N] [--json FILE]

A token model (``gpt2``, ``bert``, ``llama``, ``t5`` from the zoo) is called
with ``dynamic=True`` at every sequence length in ``--lengths`` (batch 1 on a
CPU, 8 on a GPU).  Backends: ``eager``, ``inductor``, ``tilec`` (the default
policy, ``specialize="hot"``: a length runs the generic variant until its
third call, and is specialized then), ``tilec:first`` (``specialize="first"``:
every new length is specialized, up to ``max_specializations``) and
``tilec:N`` (``specialize="first"`` with ``max_specializations=N``: beyond
``N`` lengths the generic variant runs; ``tilec:0`` runs only the generic
variant).  For each backend
it reports

* ``programs_first_pass``: programs compiled after one call per length (a
  decode-like workload: every call a new length),
* ``programs``: programs the backend compiled by the end, after every length
  was called again ``--runs + 1`` times (a serving-like workload: lengths
  repeat) (Dynamo graphs for Inductor; tilec's specialized and generic programs),
* ``first_pass_s``: one call per length, compilations included,
* ``median_ms``: per length, the median of ``--runs`` timed calls after one
  warm-up (CUDA events on a GPU), and their geometric mean over lengths,
* ``max_error``: the largest absolute difference from eager over all lengths.

On a CPU tilec's kernels run in the Triton interpreter: its times there say
nothing about GPU speed; the compile counts and the errors do.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

import tilec
from benchmarks.measure import _Timer
from benchmarks.zoo import MODELS

TOKEN_MODELS = ("gpt2", "bert", "llama", "t5")

# What a CPU run's times are (said under every CPU table).
CPU_NOTE = " (CPU: tilec's kernels run in the Triton interpreter)"


def _compiled(model: torch.nn.Module, backend: str):
    if backend == "eager":
        return model
    name, _, limit = backend.partition(":")
    if name == "inductor":
        return torch.compile(model, backend="inductor", dynamic=True)
    if name == "tilec":
        if limit == "first":
            options = {"specialize": "first"}
        else:
            options = {"specialize": "first", "max_specializations": int(limit)} if limit else None
        return torch.compile(model, backend="tilec", dynamic=True, options=options)
    raise ValueError(
        f"unknown backend {backend!r}; expected eager, inductor, tilec, tilec:N or tilec:first"
    )


def run_backend(
    model: torch.nn.Module,
    inputs: dict[int, tuple[torch.Tensor, ...]],
    expected: dict[int, torch.Tensor],
    backend: str,
    runs: int,
    device: str,
) -> dict:
    frames_before = start_counting()
    fn = _compiled(model, backend)
    timer = _Timer(device)
    error = 0.0
    with torch.no_grad():
        start = time.perf_counter()
        for length, ins in inputs.items():
            out = fn(*ins)
            error = max(error, (out.float() - expected[length].float()).abs().max().item())
        if device == "cuda":
            torch.cuda.synchronize()
        first_pass = time.perf_counter() - start
        programs_first_pass = programs_compiled(backend, frames_before)
        medians = {}
        for length, ins in inputs.items():
            fn(*ins)
            medians[length] = statistics.median(timer(lambda i=ins: fn(*i)) for _ in range(runs))
    return {
        "backend": backend,
        "programs_first_pass": programs_first_pass,
        "programs": programs_compiled(backend, frames_before),
        "first_pass_s": first_pass,
        "median_ms": {n: t * 1000 for n, t in medians.items()},
        "geomean_ms": math.exp(statistics.fmean(math.log(t * 1000) for t in medians.values())),
        "max_error": error,
        "fallbacks": tilec.stats()["fallbacks"] if backend.startswith("tilec") else None,
    }


def start_counting() -> int:
    """Forget compiled graphs and zero tilec's counters; returns Dynamo's graph
    count, for :func:`programs_compiled`."""
    torch._dynamo.reset()
    tilec.reset_stats()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def programs_compiled(backend: str, frames_before: int) -> int:
    """Programs compiled so far: tilec's own count, Dynamo graphs for Inductor."""
    if backend == "eager":
        return 0
    if backend.startswith("tilec"):
        return tilec.stats()["graphs"]
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="gpt2",
        choices=TOKEN_MODELS,
        help="token model from the zoo (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        default=None,
        choices=("tiny", "full"),
        help="model configuration (default: full on a GPU, tiny on a CPU)",
    )
    parser.add_argument(
        "--lengths",
        default="5,7,8,11,13,16,19,24,29,32",
        help="comma-separated sequence lengths, called in turn (default: %(default)s)",
    )
    parser.add_argument(
        "--backends",
        default="eager,inductor,tilec,tilec:first,tilec:4,tilec:0",
        help="comma-separated, each compiled with dynamic=True (default: %(default)s): "
        "eager (not compiled); inductor; tilec, its default policy (specialize='hot': a "
        "length runs the generic variant until its third call, then gets a specialized "
        "one, up to max_specializations=64); tilec:first (specialize='first': every new "
        "length gets a specialized variant at its first call, up to 64); tilec:N "
        "(specialize='first' and max_specializations=N: after N lengths the others run the "
        "generic variant; tilec:0 runs only the generic variant)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="timed calls per length after one warm-up; the median is reported "
        "(default: 20 on a GPU, 3 on a CPU)",
    )
    parser.add_argument(
        "--json", default=None, help="also write the results to this JSON file (default: none)"
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("full" if device == "cuda" else "tiny")
    runs = args.runs or (20 if device == "cuda" else 3)
    batch = 8 if device == "cuda" else 1
    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = spec.build(size).model.eval().to(device)
    lengths = [int(n) for n in args.lengths.split(",")]
    inputs = {}
    for n in lengths:
        # The zoo's token ids (its vocabulary), repeated to length n.
        ins = spec.inputs(size, batch, torch.Generator().manual_seed(n))
        reps = -(-n // ins[0].shape[1])
        inputs[n] = tuple(torch.cat([t] * reps, 1)[:, :n].to(device) for t in ins)
    with torch.no_grad():
        expected = {n: model(*ins) for n, ins in inputs.items()}
    results = [
        run_backend(model, inputs, expected, b, runs, device) for b in args.backends.split(",")
    ]
    print(
        f"{args.model} ({size}) on {device}, batch {batch}, {len(lengths)} sequence lengths "
        f"{lengths}, dynamic=True, {runs} timed calls per length"
        + ("" if device == "cuda" else CPU_NOTE)
    )
    print(
        f"{'backend':<10} {'programs after 1 pass / all':>28} {'first pass s':>12} "
        f"{'geomean ms':>11} {'max error':>10}"
    )
    for r in results:
        programs = f"{r['programs_first_pass']} / {r['programs']}"
        print(
            f"{r['backend']:<10} {programs:>28} {r['first_pass_s']:>12.2f} "
            f"{r['geomean_ms']:>11.3f} {r['max_error']:>10.2e}"
            + (f"  fallbacks {r['fallbacks']}" if r["fallbacks"] else "")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "size": size, "device": device, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
