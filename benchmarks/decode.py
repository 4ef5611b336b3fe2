"""Greedy decoding with ``model.generate``: tokens per second, compilations, fallbacks.

    python -m benchmarks.decode [--models llama,gpt2] [--size tiny|full]
        [--caches static,dynamic] [--backends eager,inductor,...] [--prompt N]
        [--new-tokens N] [--runs N] [--json FILE] [--check]

The zoo's LLaMA-style and GPT-2 models (``benchmarks/zoo.py``, random
weights) generate ``--new-tokens`` tokens greedily after a ``--prompt``-token
prompt, with the static KV cache (``cache_implementation="static"``, the
compiled ``forward`` captured whole: ``fullgraph=True``) and with the default
dynamic cache.  ``model.forward`` is compiled by each backend: ``eager``
(not compiled), ``inductor`` and ``inductor:reduce-overhead``, ``tilec`` and
``tilec:reduce-overhead`` (``mode="reduce-overhead"``), ``tilec:direct``
(the option ``direct_launch``: kernels launched without Triton's JIT
dispatch, ``runtime/launcher.py``) and ``tilec:reduce-overhead-pdl``
(the options ``cudagraphs``, which is what ``reduce-overhead`` means to
tilec, and ``pdl``: kernels launched with
programmatic dependent launch, on GPUs of compute capability 9.0+; elsewhere
it is ``tilec:reduce-overhead`` again).  Every backend decodes
a fresh copy of the same model in the same process.  For each it reports

* ``first_generate_s``: the first ``generate``, compilations included,
* ``tokens_per_s``: new tokens over the median of ``--runs`` timed
  ``generate`` calls after it (synchronized on a GPU),
* ``programs``: graphs compiled (tilec's ``stats()["graphs"]``; Dynamo's
  graphs for Inductor), and tilec's ATen ``fallbacks``,
* ``same_tokens``: whether the generated tokens equal eager's.

``--check`` is the CPU check the test suite runs: tiny models, a short
prompt, few tokens, eager and tilec only.  On a CPU Inductor's
``reduce-overhead`` mode is left out (CUDA graphs need a GPU), and tilec's
kernels run in the Triton interpreter: its tokens per second there say
nothing about GPU speed; its compilations, fallbacks and tokens do.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

import tilec
from benchmarks.dynamic import CPU_NOTE, programs_compiled, start_counting
from benchmarks.measure import _Timer
from benchmarks.progress import Progress
from benchmarks.zoo import MODELS

DECODERS = ("llama", "gpt2")
BACKENDS = (
    "eager",
    "inductor",
    "inductor:reduce-overhead",
    "tilec",
    "tilec:direct",
    "tilec:reduce-overhead",
    "tilec:reduce-overhead-pdl",
)
# Backends named for options: the name after the colon -> the mode and the
# options (torch.compile takes a mode or options, not both: the option
# ``cudagraphs`` is what ``reduce-overhead`` means to tilec).
VARIANTS = {
    "direct": (None, {"direct_launch": True}),
    "reduce-overhead-pdl": (None, {"cudagraphs": True, "pdl": True}),
}
CHECK_BACKENDS = ("eager", "tilec")


def decoder(name: str, size: str) -> torch.nn.Module:
    """The zoo model's ``transformers`` model itself (the zoo wraps it to return logits)."""
    return MODELS[name].build(size).model.model.eval()


def skip_reason(backend: str, device: str) -> str | None:
    if backend == "inductor:reduce-overhead" and device != "cuda":
        return "CUDA graphs need a GPU"
    return None


def _compile(model: torch.nn.Module, backend: str, cache: str) -> None:
    if backend == "eager":
        return
    name, _, mode = backend.partition(":")
    mode, options = VARIANTS.get(mode, (mode, None))
    # The static cache keeps every shape fixed: one graph per phase, captured whole.
    model.forward = torch.compile(
        model.forward,
        backend=name,
        mode=mode or None,
        options=options,
        fullgraph=cache == "static",
    )


def run_backend(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    cache: str,
    new_tokens: int,
    backend: str,
    runs: int,
    device: str,
) -> dict:
    frames_before = start_counting()
    model = copy.deepcopy(model)
    _compile(model, backend, cache)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    timer = _Timer(device)
    with torch.no_grad():
        start = time.perf_counter()
        tokens = model.generate(prompt, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - start
        times = [timer(lambda: model.generate(prompt, **kwargs)) for _ in range(runs)]
    seconds = statistics.median(times)
    return {
        "backend": backend,
        "cache": cache,
        "first_generate_s": first,
        "median_generate_s": seconds,
        "tokens_per_s": new_tokens / seconds,
        "programs": programs_compiled(backend, frames_before),
        "fallbacks": tilec.stats()["fallbacks"] if backend.startswith("tilec") else None,
        "tokens": tokens[:, prompt.shape[1] :].tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(DECODERS),
        help="comma-separated decoders from the zoo (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        default=None,
        choices=("tiny", "full"),
        help="model configuration (default: full on a GPU; tiny on a CPU or with --check)",
    )
    parser.add_argument(
        "--caches",
        default="static,dynamic",
        help="comma-separated KV caches: static (cache_implementation='static', forward "
        "compiled with fullgraph=True) and/or dynamic (transformers' default cache) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends compiling model.forward: eager (not compiled), "
        "inductor or tilec, optionally followed by :MODE, the torch.compile mode, e.g. "
        f"tilec:reduce-overhead (default: {','.join(BACKENDS)}; with --check: "
        f"{','.join(CHECK_BACKENDS)}); inductor:reduce-overhead is skipped on a CPU",
    )
    parser.add_argument(
        "--prompt", type=int, default=None, help="prompt tokens (default: 16; --check: 5)"
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens each generate call adds greedily (default: 32; --check: 4)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="timed generate calls after the first; the median is reported "
        "(default: 10 on a GPU, 5 on a CPU, 1 with --check)",
    )
    parser.add_argument(
        "--json", default=None, help="also write the results to this JSON file (default: none)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="the CPU check the test suite runs: tiny models, a 5-token prompt, 4 new tokens, "
        "eager and tilec only",
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("tiny" if args.check or device == "cpu" else "full")
    backends = args.backends.split(",") if args.backends else list(BACKENDS)
    if args.check and not args.backends:
        backends = list(CHECK_BACKENDS)
    new_tokens = args.new_tokens or (4 if args.check else 32)
    prompt_length = args.prompt or (5 if args.check else 16)
    runs = args.runs or (1 if args.check else 5 if device == "cpu" else 10)
    models, caches = args.models.split(","), args.caches.split(",")
    compiled = [b for b in backends if b != "eager" and skip_reason(b, device) is None]
    progress = Progress(len(models) * len(caches) * (1 + len(compiled)))
    results, skipped = [], []
    for name in models:
        torch.manual_seed(0)
        model = decoder(name, size).to(device)
        vocab = model.config.vocab_size
        prompt = torch.randint(1, vocab, (1, prompt_length), generator=torch.Generator()).to(device)
        for cache in caches:
            progress.start(f"{name} {cache} eager")
            eager = run_backend(model, prompt, cache, new_tokens, "eager", runs, device)
            progress.end(f"{eager['tokens_per_s']:.3g} tokens/s")
            for backend in backends:
                reason = skip_reason(backend, device)
                if reason is not None:
                    where = {"model": name, "cache": cache, "backend": backend}
                    skipped.append({**where, "reason": reason})
                    continue
                row = eager
                if backend != "eager":
                    progress.start(f"{name} {cache} {backend}")
                    row = run_backend(model, prompt, cache, new_tokens, backend, runs, device)
                same = row["tokens"] == eager["tokens"]
                if backend != "eager":
                    progress.end(
                        f"{row['tokens_per_s']:.3g} tokens/s, same tokens as eager: {same}"
                    )
                results.append({"model": name, **row, "same_tokens": same})
    _print_table(results, skipped, size, device, prompt_length, new_tokens, runs)
    if args.json:
        with open(args.json, "w") as f:
            report = {"size": size, "device": device, "prompt": prompt_length}
            report |= {"new_tokens": new_tokens, "results": results, "skipped": skipped}
            json.dump(report, f, indent=1)
    return 0


def _print_table(results, skipped, size, device, prompt, new_tokens, runs) -> None:
    print(
        f"greedy decode ({size}) on {device}: {prompt}-token prompt, {new_tokens} new tokens, "
        f"median of {runs} generate calls" + ("" if device == "cuda" else CPU_NOTE)
    )
    print(
        f"{'model':<6} {'cache':<8} {'backend':<25} {'tokens/s':>9} {'first s':>8} "
        f"{'programs':>8} {'same tokens':>11}  fallbacks"
    )
    for r in results:
        fallbacks = "" if r["fallbacks"] is None else sum(r["fallbacks"].values())
        print(
            f"{r['model']:<6} {r['cache']:<8} {r['backend']:<25} {r['tokens_per_s']:>9.2f} "
            f"{r['first_generate_s']:>8.2f} {r['programs']:>8} {str(r['same_tokens']):>11}  "
            f"{fallbacks}"
        )
    for s in skipped:
        print(f"skipped {s['model']} {s['cache']} {s['backend']}: {s['reason']}")


if __name__ == "__main__":
    sys.exit(main())
