"""Static decode report: one LLM decode step for the GPU target, without a GPU.

    python -m benchmarks.static --decode [--shape tinyllama-1.1b|llama2-7b]
        [--layers N] [--from-layers N] [--cache N] [--batches 1,8]
        [--schemes bf16,int8,int4] [--no-inductor] [--split-combine]
        [--gemv-reduction] [--chain] [--out DIR]

A LLaMA-style model of TinyLlama-1.1B's shape (or with ``--shape
llama2-7b`` Llama-2-7B's, extrapolated from ``--from-layers`` layers:
:func:`run_extrapolated`) (hidden 2048, 22 layers, 32
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
* Inductor: its Triton kernels and library calls for the same step
  (``benchmarks.inductor_gpu``), priced the same way (:func:`inductor_row`):
  launches, library calls, bytes against the ideal, tokens/s.  bf16 with
  Inductor's defaults (the products are library calls); int8 and int4 as
  gpt-fast quantizes and compiles (:func:`gpt_fast_quantized`: int8 weights
  converted in the product, which ``coordinate_descent_tuning`` makes a
  reduction kernel for one row; int4 as tinygemm library calls);
* tilec's kernels compiled for sm_90 (:func:`sm90_check`): any that fails,
  spills, or asks for more shared memory than a block may have (a kernel
  Triton would refuse to launch).

Everything it prints is a PREDICTION FROM STATIC ANALYSIS, not a GPU timing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton

from benchmarks.static import (
    GPU,
    NOTICE,
    Captured,
    compile_all,
    kernel_prediction,
    library_calls,
    library_predictions,
    programs_overcounted,
    tilec_graphs,
)
from tilec import cost
from tilec.codegen.record import kernel_entry
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
# Llama-2-7B's shape (multi-head attention), the model of gpt-fast's
# published decode figures; too large to build here (13.5 GB of bf16
# weights, more once q/k/v and gate/up are merged), so its report is
# extrapolated from a few layers (``--from-layers``).
LLAMA2_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
SHAPES = {"tinyllama-1.1b": SHAPE, "llama2-7b": LLAMA2_7B}
SCHEMES = {"bf16": None, "int8": "int8_weight_only", "int4": "int4_weight_only"}


@dataclasses.dataclass
class Decoder:
    """A model with a filled static cache, and its decode step's inputs."""

    model: torch.nn.Module
    cache: Any
    inputs: tuple[torch.Tensor, torch.Tensor]
    # The forward's keyword for the cache (:func:`cache_keyword`).
    keyword: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.keyword = cache_keyword(self.model)

    def step(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return _forward(self.model, ids, {self.keyword: self.cache}, position).logits


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` in
    recent transformers (5.24 here), ``past_key_values`` in earlier ones
    (5.17 on the GPU machine, 4.x).  A cache passed by the other name lands
    in the forward's ``**kwargs`` and is ignored: the step then runs
    without it and writes no cache (the first GPU run of ``decode_step``)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _forward(
    model: torch.nn.Module, ids: torch.Tensor, cache: dict[str, Any], position: torch.Tensor
) -> Any:
    """``model``'s step at ``position`` with ``cache`` ({its keyword: the cache})."""
    return model(ids, cache_position=position, use_cache=True, **cache)


def decoder(
    batch: int,
    cache: int,
    shape: dict[str, int],
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    writes_last: bool = True,
) -> Decoder:
    """The model (random weights, ``dtype``, on ``device``) with a static
    cache of ``cache`` positions made by one eager step, and the inputs of
    the step that decodes its last position.

    transformers 5.x's ``StaticCache`` writes a step's entry where a counter
    of its own says (``cumulative_length``, advanced in place), not at
    ``cache_position``.  With ``writes_last`` the counter is set to the last
    position too, so the step writes the entry it reads last; without it
    the counter stays after the first step's entry, leaving room for the
    many steps a GPU timing runs (every step reads the whole cache either
    way: the mask reaches the last position)."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    static = StaticCache(config=config, max_cache_len=cache)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        first = torch.tensor([0], device=device)
        _forward(model, ids, {cache_keyword(model): static}, first)
    for layer in getattr(static, "layers", ()) if writes_last else ():
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(cache - 1)
    return Decoder(model, static, (ids, torch.tensor([cache - 1], device=device)))


def replayed_seconds(prediction: cost.Prediction) -> float:
    """Seconds of one launch inside a replayed CUDA graph."""
    return dataclasses.replace(prediction, launch_s=cost.launch_seconds(GPU, True)).seconds


def _kernel_seconds(captured: Captured) -> float:
    return sum(replayed_seconds(kernel_prediction(kernel)) for kernel in captured.kernels)


def _library_seconds(calls: list[dict[str, Any]]) -> float:
    return sum(replayed_seconds(p) for p in library_predictions(calls))


def step_seconds(captured: Captured) -> float:
    """Predicted seconds of a decode step's graph replayed: its kernels and
    library calls, each one replayed launch."""
    return _kernel_seconds(captured) + _library_seconds(library_calls(captured.graph))


def step_options(scheme: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """tilec's options for a decode step of weight ``scheme``, as under
    ``reduce-overhead`` (its choices priced with a replay's launches), and
    ``extra`` ones (``split_combine``, ``gemv_reduction``, ``chain``)."""
    options: dict[str, Any] = {"freeze": True, "cudagraphs": True, **(extra or {})}
    if SCHEMES[scheme]:
        options |= {"quantize": SCHEMES[scheme], "quantize_head": True}
    return options


def the_step(graphs: list[Any]) -> Any:
    """The decode step among the graphs (or programs) of a compiled step:
    the one that writes the caches."""
    steps = [g for g in graphs if len(g.graph.mutations) > 1]
    if len(steps) != 1:
        writes = [len(g.graph.mutations) for g in graphs]
        raise RuntimeError(
            f"expected one decode graph writing the cache, got {len(steps)} "
            f"(inputs written by each of the {len(graphs)} graphs: {writes})"
        )
    return steps[0]


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


def tilec_row(
    decode: Decoder,
    scheme: str,
    batch: int,
    extra: dict[str, Any] | None = None,
    sm90: bool = True,
) -> dict[str, Any]:
    options = Options.from_user(None, step_options(scheme, extra))
    c = the_step(tilec_graphs(decode.step, decode.inputs, options))
    calls = library_calls(c.graph)
    kernel_bytes = sum(k.bytes_read + k.bytes_written for k in c.kernels)
    library_bytes = sum(call["bytes"] for call in calls)
    ideal = ideal_step_bytes(c.graph, batch)
    seconds = step_seconds(c)
    waits = sum(max(len(k.stages) - 1, 0) for k in c.kernels)
    caches = [v for k, v in c.graph.mutations.items() if c.graph.nodes[c.graph.outputs[k]].shape]
    return (
        {
            "scheme": scheme,
            "batch": batch,
            "launches": len(c.kernels),
            "stage_waits": waits,
            "library_calls": len(calls),
            "fallbacks": c.fallbacks,
            "caches_written": len(caches),
            "caches_in_place": len(
                set(caches) & {c.graph.inputs.index(i) for i in c.graph.in_place.values()}
            ),
            "kernel_bytes": kernel_bytes,
            "library_bytes": library_bytes,
            "ideal_bytes": ideal,
            "predicted_step_s": seconds,
            "_captured": c,
        }
        | ({"sm90": sm90_check(c)} if sm90 else {})
        | derived(
            batch, kernel_bytes + library_bytes, ideal, seconds, len(c.kernels) + len(calls), waits
        )
    )


def sm90_check(captured: Captured, jobs: int = 1) -> dict[str, Any]:
    """The step's kernels compiled for sm_90 (each source once): how many
    distinct ones, those that fail to compile, spill (bytes) or ask for
    more shared memory than a block may have (bytes; Triton refuses to
    launch them), the most shared memory one asks for, and the GEMM
    kernels of which the cost model counts more programs an SM
    (``GemmConfig.k_loop``, its waves) than their compiled registers and
    shared memory let run (``[counted, compiled]``)."""
    entries = [kernel_entry(captured.graph, k.group, k, GPU) for k in captured.kernels]
    compiled = compile_all(entries, jobs)
    results = {r["name"]: r for r in compiled}.values()
    limit = GPU.shared_memory_per_block
    overcounted = {}
    for kernel, result in zip(captured.kernels, compiled):
        over = programs_overcounted(kernel, result)
        if over is not None:
            overcounted[result["name"]] = over
    return {
        "kernels": len(results),
        "failed": sorted(r["name"] for r in results if not r["ok"]),
        "spills": {r["name"]: r["spill_bytes"] for r in results if r.get("spill_bytes")},
        "over_shared": {r["name"]: r["shared"] for r in results if r.get("shared", 0) > limit},
        "max_shared": max((r.get("shared", 0) for r in results), default=0),
        "programs_overcounted": overcounted,
    }


def derived(
    batch: int, step_bytes: int, ideal: int, seconds: float, launches: int, waits: int = 0
) -> dict[str, Any]:
    """A row's figures that follow from its counts: bytes against the ideal,
    tokens/s, the bandwidth limit's tokens/s, and the launch bound's: the
    ideal bytes at the copy bandwidth plus ``launches`` (kernels and library
    calls) at the replayed launch's figure and ``waits`` (chained kernels'
    stages after their first, ``passes/chain.py``) at the chain's, which no
    step of that many launches and waits beats in the cost model."""
    limit_s = cost.memory_seconds(GPU, ideal)
    overhead_s = launches * cost.launch_seconds(GPU, True) + waits * GPU.chain_wait_s.value
    return {
        "step_bytes": step_bytes,
        "bytes_over_ideal": step_bytes / ideal,
        "tokens_per_s": batch / seconds,
        "limit_tokens_per_s": batch / limit_s,
        "launch_bound_tokens_per_s": batch / (limit_s + overhead_s),
    }


class Int8Linear(torch.nn.Module):
    """gpt-fast's weight-only int8 linear layer: int8 weights per output
    channel (symmetric, absmax / 127) converted to the input's dtype in the
    product, the scales applied to its result."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer("weight", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype)) * self.scales


class Int4Linear(torch.nn.Module):
    """gpt-fast's weight-only int4 linear layer: the tinygemm kernel
    (``_weight_int4pack_mm``, a library call) on weights packed two to a
    byte with a bf16 scale and zero per group of ``group`` inputs.  Here
    the CPU variant of the op and its packing (same bytes; the report
    generates code, nothing runs)."""

    def __init__(self, linear: torch.nn.Linear, group: int = 128):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.reshape(n, k // group, group)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-6)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.reshape(n, k).to(torch.int32), 2
        )
        self.register_buffer("weight", packed)
        zero = low + 8 * scale  # tinygemm's zero point: the value of code 8
        scales = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales.to(linear.weight.dtype))
        self.group, self.out_features = group, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.weight, self.group, self.scales_and_zeros
        )
        return out.reshape(*x.shape[:-1], self.out_features)


GPT_FAST = {"int8": Int8Linear, "int4": Int4Linear}


def gpt_fast_quantized(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """A copy of ``model`` with every linear layer (the head too) as gpt-fast
    quantizes it for ``scheme``."""
    quantized = copy.deepcopy(model)
    for module in list(quantized.modules()):
        for child, layer in list(module.named_children()):
            if isinstance(layer, torch.nn.Linear):
                setattr(module, child, GPT_FAST[scheme](layer))
    return quantized


def inductor_row(decode: Decoder, batch: int, ideal: int, scheme: str = "bf16") -> dict[str, Any]:
    """Inductor's kernels and library calls for the same (bf16) step, priced
    as tilec's are (each a launch of a replayed CUDA graph, kernels by their
    bytes, library calls by their FLOPs and bytes).

    A kernel's bytes are Inductor's per-kernel estimate
    (``InductorKernel.kernel_bytes``), not its scheduler's count: the
    scheduler counts a gathered table whole (the embedding, fused into every
    RMSNorm kernel that recomputes the residual stream's first term: 131 MB
    each where a GPU reads a row) and the in-place cache write-back as the
    whole cache.  Inductor's kernels are priced without the fill rule (their
    grid is chosen by autotuning on a GPU), which can only flatter them."""
    from benchmarks.inductor_gpu import inductor_gpu_kernels

    if scheme != "bf16":
        decode = dataclasses.replace(decode, model=gpt_fast_quantized(decode.model, scheme))
    report = inductor_gpu_kernels(decode.step, decode.inputs, gemv_as_reduction=scheme == "int8")
    unknown = [k.name for k in report.kernels if k.kernel_bytes is None]
    if unknown:
        raise RuntimeError(f"Inductor kernels without a byte estimate: {unknown}")
    kernel_bytes = sum(k.kernel_bytes * k.launches for k in report.kernels)
    library_bytes = sum(call["bytes"] for call in report.library)
    kernel_s = sum(
        k.launches * replayed_seconds(cost.kernel(GPU, k.kernel_bytes)) for k in report.kernels
    )
    seconds = kernel_s + _library_seconds(report.library)
    return {
        "launches": report.launches,
        "library_calls": report.extern_calls,
        "kernel_bytes": kernel_bytes,
        "library_bytes": library_bytes,
        "ideal_bytes": ideal,
        "predicted_step_s": seconds,
    } | derived(
        batch,
        kernel_bytes + library_bytes,
        ideal,
        seconds,
        report.launches + report.extern_calls,
    )


# The counts of a row that grow by the same amount with each decoder layer.
PER_LAYER = (
    "launches",
    "stage_waits",
    "library_calls",
    "caches_written",
    "caches_in_place",
    "kernel_bytes",
    "library_bytes",
    "ideal_bytes",
    "predicted_step_s",
)


def extrapolated(a: dict[str, Any], b: dict[str, Any], layers: int) -> dict[str, Any]:
    """The row of a ``layers``-layer model from rows ``a`` and ``b`` of the
    same model with ``a["layers"]`` and one more layer: every count in
    :data:`PER_LAYER` grows linearly (the layers are alike), the figures
    that follow from them recomputed; the Inductor side likewise."""
    grow = layers - a["layers"]

    def line(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
        counts = {k: x[k] + grow * (y[k] - x[k]) for k in PER_LAYER if k in x}
        step_bytes = counts["kernel_bytes"] + counts["library_bytes"]
        return (
            x
            | counts
            | derived(
                a["batch"],
                step_bytes,
                counts["ideal_bytes"],
                counts["predicted_step_s"],
                counts["launches"] + counts["library_calls"],
                counts.get("stage_waits", 0),
            )
        )

    row = line(a, b) | {"layers": layers, "extrapolated_from": [a["layers"], b["layers"]]}
    if a.get("inductor"):
        row["inductor"] = line(a["inductor"], b["inductor"])
    return row


def _waits(row: dict[str, Any]) -> str:
    """A row's chained stages after their first (none without ``chain``)."""
    waits = row.get("stage_waits", 0)
    return f" + {waits} waits" if waits else ""


def _fixed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# Static decode report ({meta['date']})",
        "",
        f"**{NOTICE}**",
        "",
        f"Command: `{meta['command']}`; torch {meta['torch']}; model {meta['shape']}, "
        f"static cache {meta['cache']} positions, decoding its last.",
        "",
        *(
            [
                f"Extrapolated: {meta['from_layers']} and {meta['from_layers'] + 1} layers "
                f"were compiled; every count that grows with the layers (launches, library "
                f"calls, bytes, predicted seconds) is extended linearly to "
                f"{meta['shape']['num_hidden_layers']}.",
                "",
            ]
            if meta.get("from_layers")
            else []
        ),
        *(
            [f"tilec's options beside the decode step's: {meta['tilec_options']}.", ""]
            if meta.get("tilec_options")
            else []
        ),
        "| scheme | batch | MB/token | ideal MB/token | over ideal | launches | library | "
        "caches in place | tok/s (tilec) | tok/s (launch bound) | tok/s (limit) | "
        "Inductor launches | Inductor library | Inductor over ideal | tok/s (Inductor) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ind = r.get("inductor") or {}
        lines.append(
            f"| {r['scheme']} | {r['batch']} | {r['step_bytes'] / r['batch'] / 1e6:.1f} | "
            f"{r['ideal_bytes'] / r['batch'] / 1e6:.1f} | {r['bytes_over_ideal']:.3f} | "
            f"{r['launches']}{_waits(r)} | {r['library_calls']} | {r['caches_in_place']}/{r['caches_written']} | "
            f"{r['tokens_per_s']:.0f} | {r['launch_bound_tokens_per_s']:.0f} | "
            f"{r['limit_tokens_per_s']:.0f} | "
            f"{ind.get('launches', '-')} | {ind.get('library_calls', '-')} | "
            f"{_fixed(ind.get('bytes_over_ideal'), 3)} | {_fixed(ind.get('tokens_per_s'), 0)} |"
        )
    lines += [
        "",
        "Launch bound: the row's ideal bytes at the copy bandwidth plus its launches "
        "(kernels and library calls) at the replayed launch's figure "
        f"({cost.launch_seconds(GPU, True) * 1e6:.2f} us) and its chained kernels' "
        f"stages after their first at the chain's wait ({GPU.chain_wait_s.value * 1e6:.2f} "
        f"us, {GPU.chain_wait_s.basis}): what a step of that many launches reaches at best "
        "in the cost model.",
        *_against_bf16(rows),
        *_sm90_lines(rows),
    ]
    return "\n".join(lines) + "\n"


def _sm90_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What compiling each row's kernels for sm_90 found (:func:`sm90_check`)."""
    checked = [r for r in rows if "sm90" in r]
    if not checked:
        return []
    limit = GPU.shared_memory_per_block
    lines = [
        "",
        f"Compiled for sm_90 (triton {triton.__version__}), each row's distinct kernels: "
        f"the most shared memory one asks for against the {limit:,} bytes a block may have, "
        "and what failed, spilled or asked for more; and the GEMM kernels of which the cost "
        "model counts more programs an SM (its waves) than their compiled registers and "
        "shared memory let run (counted > compiled).",
        "",
        "| scheme | batch | kernels | most shared (bytes) | failed | spills (bytes) | over shared "
        "| programs an SM counted > compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in checked:
        c = r["sm90"]
        spills = ", ".join(str(b) for b in c["spills"].values()) or "none"
        over = c.get("programs_overcounted")
        counted = "not checked" if over is None else ", ".join(
            f"{a} > {b}" for a, b in over.values()
        ) or "none"  # fmt: skip
        lines.append(
            f"| {r['scheme']} | {r['batch']} | {c['kernels']} | {c['max_shared']:,} | "
            f"{len(c['failed']) or 'none'} | {spills} | {len(c['over_shared']) or 'none'} "
            f"| {counted} |"
        )
    return lines


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each quantized row's tokens/s over the bf16 row of its batch: tilec's,
    the launch bounds' (each row's own launches), the bandwidth limits' and
    Inductor's."""
    bf16 = {r["batch"]: r for r in rows if r["scheme"] == "bf16"}
    keys = ("tokens_per_s", "launch_bound_tokens_per_s", "limit_tokens_per_s")
    out = []
    for r in rows:
        base = bf16.get(r["batch"])
        if r["scheme"] == "bf16" or base is None:
            continue
        ratios = {key: r[key] / base[key] for key in keys}
        ind, base_ind = r.get("inductor"), base.get("inductor")
        ratios["inductor"] = (
            ind["tokens_per_s"] / base_ind["tokens_per_s"] if ind and base_ind else None
        )
        out.append({"scheme": r["scheme"], "batch": r["batch"]} | ratios)
    return out


def _against_bf16(rows: list[dict[str, Any]]) -> list[str]:
    ratios = speedups(rows)
    if not ratios:
        return []
    lines = [
        "",
        "Tokens/s over bf16's at the same batch:",
        "",
        "| scheme | batch | tilec | launch bound | limit | Inductor |",
        "|---|---|---|---|---|---|",
    ]
    for r in ratios:
        lines.append(
            f"| {r['scheme']} | {r['batch']} | {r['tokens_per_s']:.2f} | "
            f"{r['launch_bound_tokens_per_s']:.2f} | {r['limit_tokens_per_s']:.2f} | "
            f"{_fixed(r['inductor'], 2)} |"
        )
    return lines


def run(
    batches: list[int],
    schemes: list[str],
    cache: int,
    shape: dict[str, int],
    inductor: bool,
    extra: dict[str, Any] | None = None,
    sm90: bool = True,
) -> list[dict[str, Any]]:
    """A row per batch and scheme for ``shape``, every layer compiled
    (tilec with the ``extra`` options; its kernels for sm_90 too with
    ``sm90``: :func:`sm90_check`)."""
    rows = []
    for batch in batches:
        decode = decoder(batch, cache, shape)
        for scheme in schemes:
            t0 = time.perf_counter()
            row = {"layers": shape["num_hidden_layers"]} | tilec_row(
                decode, scheme, batch, extra, sm90
            )
            if inductor:
                row["inductor"] = inductor_row(decode, batch, row["ideal_bytes"], scheme)
            row["seconds"] = time.perf_counter() - t0
            del row["_captured"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "fallbacks"}), flush=True)
        del decode
    return rows


def run_extrapolated(
    batches: list[int],
    schemes: list[str],
    cache: int,
    shape: dict[str, int],
    inductor: bool,
    layers: int,
    extra: dict[str, Any] | None = None,
    sm90: bool = True,
) -> list[dict[str, Any]]:
    """:func:`run` for ``shape`` from ``layers`` and ``layers + 1`` of its
    layers compiled (:func:`extrapolated`); with ``sm90``, the first's
    kernels compiled for sm_90 (one more layer adds none of another
    source)."""
    few, more = (
        run(
            batches,
            schemes,
            cache,
            shape | {"num_hidden_layers": n},
            inductor,
            extra,
            sm90 and n == layers,
        )
        for n in (layers, layers + 1)
    )
    return [extrapolated(a, b, shape["num_hidden_layers"]) for a, b in zip(few, more)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="static decode report (predictions)")
    parser.add_argument("--shape", choices=SHAPES, default="tinyllama-1.1b")
    parser.add_argument("--layers", type=int, help="layers (default: the shape's)")
    parser.add_argument(
        "--from-layers",
        type=int,
        help="compile this many layers and one more, and extrapolate to --layers",
    )
    parser.add_argument("--cache", type=int, default=2048, help="static cache positions")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument(
        "--split-combine",
        action="store_true",
        help="tilec with the option split_combine (not yet run on a GPU)",
    )
    parser.add_argument(
        "--gemv-reduction",
        action="store_true",
        help="tilec with the option gemv_reduction (not yet run on a GPU)",
    )
    parser.add_argument(
        "--chain",
        action="store_true",
        help="tilec with the option chain (not yet run on a GPU)",
    )
    parser.add_argument("--out", type=Path, default=Path("static-report/decode"))
    args = parser.parse_args(argv)
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        parser.error(f"unknown scheme {unknown[0]!r}; known: {', '.join(SCHEMES)}")
    shape = SHAPES[args.shape]
    shape = shape | {"num_hidden_layers": args.layers or shape["num_hidden_layers"]}
    if args.from_layers is not None and not 1 <= args.from_layers < shape["num_hidden_layers"]:
        parser.error(f"--from-layers must be 1 to {shape['num_hidden_layers'] - 1}")
    print(NOTICE)
    batches = [int(b) for b in args.batches.split(",")]
    inductor = not args.no_inductor
    flags = {
        "split_combine": args.split_combine,
        "gemv_reduction": args.gemv_reduction,
        "chain": args.chain,
    }
    extra = {name: True for name, on in flags.items() if on}
    if args.from_layers is None:
        rows = run(batches, schemes, args.cache, shape, inductor, extra)
    else:
        rows = run_extrapolated(
            batches, schemes, args.cache, shape, inductor, args.from_layers, extra
        )
    meta = {
        "notice": NOTICE,
        "command": "python -m benchmarks.static --decode " + " ".join(argv),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "shape_name": args.shape,
        "shape": shape,
        "cache": args.cache,
        "from_layers": args.from_layers,
        "tilec_options": extra,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(
        json.dumps({**meta, "rows": rows, "against_bf16": speedups(rows)}, indent=2)
    )
    (args.out / "report.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
