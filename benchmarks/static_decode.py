"""Static decode report: one LLM decode step for the GPU target, without a GPU.

    python -m benchmarks.static --decode [--layers N] [--cache N]
        [--batches 1,8] [--schemes bf16,int8,int4] [--no-inductor] [--out DIR]

A LLaMA-style model of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32
query heads and 4 key/value heads of 64, MLP 5632, vocabulary 32000;
``transformers``' ``LlamaForCausalLM`` with random weights, bf16) with a
static KV cache of ``--cache`` positions (2048), filled but for its last
position: the step decodes that position, so it reads the whole cache.
The cache is made by one eager step of one token; the decode step itself
is only compiled, for an H100 (``benchmarks.static.tilec_graphs``), never
run.  For each weight scheme (bf16; ``int8_weight_only`` and
``int4_weight_only``, group 128, every linear layer quantized, the output
head too, as gpt-fast quantizes) and batch:

* bytes a step moves: tilec's kernels (codegen's accounting) plus its
  library calls' operands and results; per token (over the batch);
* the ideal: every weight the step reads read once at its stored size (the
  embedding: the batch's rows), the live cache read once, the new cache
  entries and the logits written once;
* launches and library calls; the cache written in place (or copied);
* predicted step time (``compiler/cost.py`` on the H100 target, kernels and
  library calls each as one launch of a replayed CUDA graph, the way a
  decode step runs under ``reduce-overhead``) and tokens/s, against the
  bandwidth limit (ideal bytes at the copy bandwidth);
* Inductor (bf16): its Triton kernels for the same step
  (``benchmarks.inductor_gpu``): launches and library calls.  Its bytes
  are not a GPU's (see :func:`inductor_row`), so no Inductor tokens/s.

Everything it prints is a PREDICTION FROM STATIC ANALYSIS, not a GPU timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.static import (
    GPU,
    NOTICE,
    Captured,
    kernel_prediction,
    library_calls,
    library_predictions,
    tilec_graphs,
)
from tilec import cost
from tilec.ir import Graph
from tilec.options import Options

SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
SCHEMES = {"bf16": None, "int8": "int8_weight_only", "int4": "int4_weight_only"}


@dataclasses.dataclass
class Decoder:
    """A model with a filled static cache, and its decode step's inputs."""

    model: torch.nn.Module
    cache: Any
    inputs: tuple[torch.Tensor, torch.Tensor]

    def step(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.model(ids, cache=self.cache, cache_position=position, use_cache=True).logits


def decoder(batch: int, cache: int, shape: dict[str, int]) -> Decoder:
    """The model (random weights, bf16) with a static cache of ``cache``
    positions made by one eager step, and the inputs of the step that
    decodes its last position."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    static = StaticCache(config=config, max_cache_len=cache)
    ids = torch.zeros(batch, 1, dtype=torch.long)
    with torch.no_grad():
        model(ids, cache=static, cache_position=torch.tensor([0]), use_cache=True)
    return Decoder(model, static, (ids, torch.tensor([cache - 1])))


def _replayed(prediction: cost.Prediction) -> float:
    """Seconds of one launch inside a replayed CUDA graph."""
    return dataclasses.replace(prediction, launch_s=cost.launch_seconds(GPU, True)).seconds


def _kernel_seconds(captured: Captured) -> float:
    return sum(_replayed(kernel_prediction(kernel)) for kernel in captured.kernels)


def _library_seconds(calls: list[dict[str, Any]]) -> float:
    return sum(_replayed(p) for p in library_predictions(calls))


def ideal_step_bytes(graph: Graph, batch: int) -> int:
    """Weights read once at their stored size (the embedding table: the
    batch's rows), the caches the step writes read whole, their new
    entries and the outputs written."""
    total = 0
    for name, tensor in graph.constants.items():
        if "embed_tokens" in graph.constant_names.get(name, ""):
            total += batch * tensor.shape[-1] * tensor.element_size()
        else:
            total += tensor.numel() * tensor.element_size()
    for k, position in graph.mutations.items():
        source = graph.nodes[graph.inputs[position]]
        total += int(source.nbytes)  # the live cache (or a counter), read
        value = graph.nodes[graph.outputs[k]]
        if value.kind == "scatter":
            total += int(torch.Size(value.update_shape).numel()) * value.dtype.itemsize
        else:
            total += int(value.nbytes)
    returned = {o for k, o in enumerate(graph.outputs) if o and k not in graph.mutations}
    return total + sum(int(graph.nodes[o].nbytes) for o in returned)


def tilec_row(decode: Decoder, scheme: str, batch: int) -> dict[str, Any]:
    # Compiled as under reduce-overhead: its choices priced with a replay's launches.
    options = {"freeze": True, "cudagraphs": True}
    if SCHEMES[scheme]:
        options |= {"quantize": SCHEMES[scheme], "quantize_head": True}
    captured = tilec_graphs(decode.step, decode.inputs, Options.from_user(None, options))
    steps = [c for c in captured if len(c.graph.mutations) > 1]
    if len(steps) != 1:
        raise RuntimeError(f"expected one decode graph writing the cache, got {len(steps)}")
    (c,) = steps
    calls = library_calls(c.graph)
    kernel_bytes = sum(k.bytes_read + k.bytes_written for k in c.kernels)
    library_bytes = sum(call["bytes"] for call in calls)
    ideal = ideal_step_bytes(c.graph, batch)
    seconds = _kernel_seconds(c) + _library_seconds(calls)
    caches = [v for k, v in c.graph.mutations.items() if c.graph.nodes[c.graph.outputs[k]].shape]
    return {
        "scheme": scheme,
        "batch": batch,
        "launches": len(c.kernels),
        "library_calls": len(calls),
        "fallbacks": c.fallbacks,
        "caches_written": len(caches),
        "caches_in_place": len(
            set(caches) & {c.graph.inputs.index(i) for i in c.graph.in_place.values()}
        ),
        "step_bytes": kernel_bytes + library_bytes,
        "kernel_bytes": kernel_bytes,
        "library_bytes": library_bytes,
        "ideal_bytes": ideal,
        "bytes_over_ideal": (kernel_bytes + library_bytes) / ideal,
        "predicted_step_s": seconds,
        "tokens_per_s": batch / seconds,
        "limit_tokens_per_s": batch / cost.memory_seconds(GPU, ideal),
        "_captured": c,
    }


def inductor_row(decode: Decoder) -> dict[str, Any]:
    """Inductor's kernels for the same (bf16) step: launches, library
    calls, and the bytes its scheduler accounts to them.  No prediction:
    its accounting reads a gathered table whole (the embedding, fused into
    every RMSNorm kernel that recomputes the residual stream's first term:
    131 MB each where a GPU reads a row) and has no figure for some kernels
    (the cache-length counter's copy), so its total is no GPU's traffic."""
    from benchmarks.inductor_gpu import inductor_gpu_kernels

    report = inductor_gpu_kernels(decode.step, decode.inputs)
    known = [k for k in report.kernels if k.bytes is not None]
    return {
        "launches": sum(k.launches for k in report.kernels),
        "library_calls": report.extern_calls,
        "accounted_kernel_bytes": sum(k.bytes * k.launches for k in known),
        "unaccounted_kernels": [k.name for k in report.kernels if k.bytes is None],
        "gather_kernels": [k.name for k in report.kernels if "embedding" in k.name],
    }


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# Static decode report ({meta['date']})",
        "",
        f"**{NOTICE}**",
        "",
        f"Command: `{meta['command']}`; torch {meta['torch']}; model {meta['shape']}, "
        f"static cache {meta['cache']} positions, decoding its last.",
        "",
        "| scheme | batch | MB/token | ideal MB/token | over ideal | launches | library | "
        "caches in place | tok/s (tilec) | tok/s (limit) | Inductor launches | Inductor library |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ind = r.get("inductor") or {}
        lines.append(
            f"| {r['scheme']} | {r['batch']} | {r['step_bytes'] / r['batch'] / 1e6:.1f} | "
            f"{r['ideal_bytes'] / r['batch'] / 1e6:.1f} | {r['bytes_over_ideal']:.3f} | "
            f"{r['launches']} | {r['library_calls']} | {r['caches_in_place']}/{r['caches_written']} | "
            f"{r['tokens_per_s']:.0f} | {r['limit_tokens_per_s']:.0f} | "
            f"{ind.get('launches', '-')} | {ind.get('library_calls', '-')} |"
        )
    return "\n".join(lines) + "\n"


def run(
    batches: list[int],
    schemes: list[str],
    cache: int,
    shape: dict[str, int],
    inductor: bool,
) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        decode = decoder(batch, cache, shape)
        for scheme in schemes:
            t0 = time.perf_counter()
            row = tilec_row(decode, scheme, batch)
            if inductor and scheme == "bf16":
                row["inductor"] = inductor_row(decode)
            row["seconds"] = time.perf_counter() - t0
            del row["_captured"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "fallbacks"}), flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="static decode report (predictions)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--cache", type=int, default=2048, help="static cache positions")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("static-report/decode"))
    args = parser.parse_args(argv)
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        parser.error(f"unknown scheme {unknown[0]!r}; known: {', '.join(SCHEMES)}")
    shape = SHAPE | {"num_hidden_layers": args.layers}
    print(NOTICE)
    batches = [int(b) for b in args.batches.split(",")]
    rows = run(batches, schemes, args.cache, shape, not args.no_inductor)
    meta = {
        "notice": NOTICE,
        "command": "python -m benchmarks.static --decode " + " ".join(argv),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "shape": shape,
        "cache": args.cache,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    (args.out / "report.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
