"""The static decode report's step, measured: the ``decode_step`` section of
``python -m benchmarks.gpu_check``.

``benchmarks/static_decode.py`` predicts, without a GPU, the tokens per
second of one decode step of a TinyLlama-shaped model with a filled static
cache, for bf16, int8 and int4 weights.  This section builds that model on
the GPU (random weights), compiles the same step with tilec under
``reduce-overhead`` (the report's options, :func:`static_decode.step_options`),
with and without programmatic dependent launch (the option ``pdl``), the
split attention's chunks combined in its own kernel (the option
``split_combine``: the rows say whether the logits still match eager's
on a GPU, whose memory ordering across programs that option relies on)
the decode GEMVs written as sum reductions (the option
``gemv_reduction``) and the kernels between two attentions chained into
one launch (the option ``chain``: again the logits say whether its waits
order the stages on a GPU), and times

* ``call``: one call of the compiled step as a user makes it (Dynamo's
  guards, the input copies, the replay, the output copies), back to back;
* ``replay`` (on a GPU): the captured CUDA graph replayed alone, back to
  back: the GPU time of the step's kernels, which is what the cost model
  predicts;

* ``kernels`` (:func:`kernel_times`): each launch of the step timed alone,
  beside its predicted time, and their sums per kind of kernel
  (``by_template``): the first GPU measurement of the step (4.2 times its
  prediction, ``benchmarks/results/gpu/2026-11-28-nvidia-h200``) could not
  say which kernels took the time;

beside ``predicted_s``, the cost model's step time for the same program's
kernels and library calls (``static_decode.step_seconds``, on the H100
target), and the bandwidth limit (the step's ideal bytes at the target's
copy bandwidth).  Each row also says whether its logits' argmax equals
eager's, and how far its logits are from them, both steps reading the same
cache.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

import tilec
from benchmarks import static_decode
from benchmarks.gpu_report import SETTINGS
from benchmarks.gpu_timing import Section, failure, release, time_loop
from benchmarks.measure import DTYPES
from benchmarks.static import GPU, Captured, kernel_prediction
from tilec import cost
from tilec.runtime.program import Program

# The options a row of the config may set after ``pdl``, in this order
# (absent ones are off): the report's settings columns.
ROW_OPTIONS = SETTINGS[1:]


def row_options(pdl: bool, *rest: bool) -> dict[str, bool]:
    """The options of a config row ``(scheme, pdl, *rest)``."""
    return {"pdl": pdl} | dict(zip(ROW_OPTIONS, (*map(bool, rest), *[False] * len(ROW_OPTIONS))))


def decode_step(s: Section) -> None:
    """Each (scheme, pdl[, split_combine[, gemv_reduction[, chain]]]) of the config's
    ``rows``, in order: the step measured against its prediction."""
    cfg = s.cfg
    shape = dict(cfg["shape"])
    s.data.update(
        shape=shape,
        cache=cfg["cache"],
        batch=cfg["batch"],
        dtype=cfg["dtype"],
        predicted_for=GPU.name,
        rows=[],
    )
    dtype = DTYPES[cfg["dtype"]]
    # Not at the last position: each timed loop runs many steps from there.
    decode = static_decode.decoder(
        cfg["batch"], cfg["cache"], shape, dtype, s.device, writes_last=False
    )
    state = _state(decode.cache)
    with torch.no_grad():
        eager = decode.step(*decode.inputs).float()
    for scheme, *flags in cfg["rows"]:
        options = row_options(*flags)
        named = " ".join(f"{name}={on}" for name, on in options.items())
        if s.out_of_time(cfg["item_min_s"], f"{scheme} {named}"):
            continue
        try:
            row = _measure(s, decode, state, scheme, options, eager)
        except Exception:
            row = {"scheme": scheme, **options, "error": failure()}
        s.data["rows"].append(row)
        s.save()
        release()
    _summarize(s)


def _state(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor of a static cache (transformers 5's layers: keys, values
    and the position counter ``cumulative_length``, which each step advances
    in place and the next step writes at; older versions' ``key_cache`` and
    ``value_cache`` lists) with a copy of its contents now, for
    :func:`_restore`."""
    tensors = [
        getattr(layer, name, None)
        for layer in getattr(cache, "layers", ())
        for name in ("keys", "values", "cumulative_length")
    ]
    tensors += [*getattr(cache, "key_cache", ()), *getattr(cache, "value_cache", ())]
    return [(t, t.clone()) for t in tensors if isinstance(t, torch.Tensor)]


def _restore(state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put a cache back as :func:`_state` saw it, in place (a captured graph
    reads and writes those very tensors).  Before a step compared with
    eager's, so both read the same cache; before each timed loop, so that
    its steps stay within the cache (the counter starts again).  Every step
    reads the whole cache whatever its position (the mask is static), so the
    time does not depend on it."""
    for tensor, saved in state:
        tensor.copy_(saved)


def _measure(
    s: Section,
    decode: static_decode.Decoder,
    state: list[tuple[torch.Tensor, torch.Tensor]],
    scheme: str,
    extra: dict[str, bool],
    eager: torch.Tensor,
) -> dict[str, Any]:
    cfg = s.cfg
    # A copy per row: freezing makes the weights constants of each compile.
    model = copy.deepcopy(decode.model)
    step = static_decode.Decoder(model, decode.cache, decode.inputs)
    options = static_decode.step_options(scheme, extra)
    torch._dynamo.reset()
    before = set(tilec.programs())
    # ``cudagraphs`` (in the options) is what ``mode="reduce-overhead"`` means
    # to tilec; torch.compile takes a mode or options, not both.
    compiled = torch.compile(step.step, backend="tilec", options=options)
    with torch.no_grad():
        for _ in range(2):  # compile and run, then capture
            compiled(*decode.inputs)
        _restore(state)
        logits = compiled(*decode.inputs)  # replayed, from eager's cache
        program = static_decode.the_step(
            [p for name, p in tilec.programs().items() if name not in before]
        )
        kernels = [launch.kernel for launch in program.launches()]
        predicted = static_decode.step_seconds(Captured(program.graph, kernels, {}))
        ideal = static_decode.ideal_step_bytes(program.graph, cfg["batch"])
        row: dict[str, Any] = {
            "scheme": scheme,
            **extra,
            "capture": program.cudagraphs,
            "launches": len(kernels),
            "launched_with_pdl": sum(k.launch.pdl for k in kernels),
            "predicted_s": predicted,
            "limit_s": cost.memory_seconds(GPU, ideal),
            "ideal_bytes": ideal,
            "argmax_equal_to_eager": bool(torch.equal(logits.argmax(-1), eager.argmax(-1))),
            "max_abs_logit_diff": (logits.float() - eager).abs().max().item(),
        }
        _restore(state)
        row["call"] = time_loop(
            lambda: compiled(*decode.inputs), s.device, cfg["calls"], cfg["repeats"]
        )
        graph = getattr(program.executor, "graph", None)
        if s.device == "cuda" and isinstance(graph, torch.cuda.CUDAGraph):
            _restore(state)
            row["replay"] = time_loop(graph.replay, s.device, cfg["calls"], cfg["repeats"])
        _restore(state)
        row["kernels"] = kernel_times(
            program, lambda: compiled(*decode.inputs), cfg["profile_calls"]
        )
        row["by_template"] = by_template(row["kernels"])
    measured = row.get("replay", row["call"])["median_s"]
    batch = cfg["batch"]
    row |= {
        "measured_over_predicted": measured / predicted,
        "tokens_per_s_call": batch / row["call"]["median_s"],
        "tokens_per_s_replay": batch / row["replay"]["median_s"] if "replay" in row else None,
        "tokens_per_s_predicted": batch / predicted,
        "tokens_per_s_limit": batch / row["limit_s"],
    }
    torch._dynamo.reset()
    return row


def kernel_times(program: Program, step: Any, calls: int) -> list[dict[str, Any]]:
    """Each kernel launch of ``program`` timed alone over ``calls`` calls of
    ``step`` (the program's profile mode: uncaptured, CUDA events around each
    launch, so each kernel starts on an idle GPU), beside its predicted time
    in a replay; costliest first.  Where a step's replay and its prediction
    part, this says which kernels part them (library calls are not timed)."""
    program.profile()
    try:
        for _ in range(calls):
            step()
        times = program.kernel_times or {}
    finally:
        program.profile(False)
    rows = []
    for launch in program.launches():
        kernel = launch.kernel
        samples = times.get(kernel.name, [])
        rows.append(
            {
                "kernel": kernel.name,
                "template": kernel.template or kernel.group.reason,
                "grid": [int(g) for g in kernel.launch.grid],
                "bytes": kernel.bytes_read + kernel.bytes_written,
                "measured_s": statistics.median(samples) if samples else None,
                "predicted_s": static_decode.replayed_seconds(kernel_prediction(kernel)),
            }
        )
    return sorted(rows, key=lambda r: -(r["measured_s"] or 0))


def by_template(kernels: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Launches, measured and predicted seconds summed per kind of kernel."""
    sums: dict[str, dict[str, float]] = {}
    for k in kernels:
        entry = sums.setdefault(
            k["template"], dict.fromkeys(("launches", "measured_s", "predicted_s"), 0)
        )
        entry["launches"] += 1
        entry["measured_s"] += k["measured_s"] or 0.0
        entry["predicted_s"] += k["predicted_s"]
    return dict(sorted(sums.items(), key=lambda item: -item[1]["measured_s"]))


def _summarize(s: Section) -> None:
    """Each scheme's tokens/s over bf16's (measured replays, and predicted),
    per setting of the options: the ratios issue 23's done-when asks of the
    prediction."""
    rows = [r for r in s.data["rows"] if "error" not in r]
    ratios = {}

    def setting(r: dict[str, Any]) -> tuple[bool, ...]:
        return (r["pdl"], *(r.get(name, False) for name in ROW_OPTIONS))

    for pdl, *flags in sorted({setting(r) for r in rows}):
        by_scheme = {r["scheme"]: r for r in rows if setting(r) == (pdl, *flags)}
        base = by_scheme.get("bf16")
        if base is None:
            continue
        on = "".join(f" {name}" for name, f in zip(ROW_OPTIONS, flags) if f)
        for scheme, r in by_scheme.items():
            key = f"{scheme}/bf16 pdl={pdl}{on}"
            measured = r["tokens_per_s_replay"] or r["tokens_per_s_call"]
            base_measured = base["tokens_per_s_replay"] or base["tokens_per_s_call"]
            ratios[key] = {
                "measured": measured / base_measured,
                "predicted": r["tokens_per_s_predicted"] / base["tokens_per_s_predicted"],
            }
    s.data["ratios"] = ratios
    errors = [r["measured_over_predicted"] for r in rows]
    s.data["median_measured_over_predicted"] = statistics.median(errors) if errors else None
    s.save()
