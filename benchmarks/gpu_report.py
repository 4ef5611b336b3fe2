"""``results.md`` of ``python -m benchmarks.gpu_check``: a short summary per section.

Every number comes from the report dict (``results.json``) as measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from benchmarks.report import markdown_table

DRY_RUN_NOTICE = (
    "**DRY RUN ON A CPU: these are CPU numbers (tilec's kernels in the Triton interpreter, "
    "CUDA graphs through the runtime's CPU stand-in, tiny models). They check that the "
    "command works and say nothing about GPU speed.**"
)


def _f(value: Any, scale: float = 1.0, spec: str = ".3g") -> str:
    return "-" if value is None else format(value * scale, spec)


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _tests(r: dict[str, Any]) -> list[str]:
    if "counts" not in r:
        return []
    counts = r["counts"]
    lines = [f"`{r.get('command', '')}`: " + ", ".join(f"{n} {k}" for k, n in counts.items())]
    lines += [f"- {line}" for line in r.get("summary_lines", [])]
    return lines + (["- timed out"] if r.get("timed_out") else [])


def _ceilings(r: dict[str, Any]) -> list[str]:
    if "bandwidth_bytes_per_s" not in r:
        return []
    return [
        f"- copy ({r['copy_bytes'] >> 20} MiB, bytes read + written): "
        f"{_f(r['bandwidth_bytes_per_s'], 1e-9)} GB/s "
        f"({_f(r['bandwidth_vs_assumed'], 1, '.2f')} x the static model's "
        f"{_f(r['assumed_bandwidth_bytes_per_s'], 1e-9, '.0f')} GB/s)",
        f"- bf16 matmul ({r['matmul_n']}^3): {_f(r['bf16_flops_per_s'], 1e-12)} TFLOP/s "
        f"({_f(r['flops_vs_assumed'], 1, '.2f')} x the static model's "
        f"{_f(r['assumed_bf16_flops_per_s'], 1e-12, '.0f')} TFLOP/s)",
    ]


def _gemms(r: dict[str, Any]) -> list[str]:
    head = ["M", "N", "K", "dtype", "models", "cuBLAS us", "template us", "predicted us"]
    head += ["cuBLAS TFLOP/s", "template TFLOP/s", "template / cuBLAS", "template tiles"]
    head += ["rel. error template / cuBLAS"]
    rows = []
    for g in r.get("rows", []):
        shape = [g["m"], g["n"], g["k"], g["dtype"], ", ".join(g["models"])]
        if "error" in g:
            rows.append(shape + ["error: " + g["error"].strip().splitlines()[-1][:80]] + [""] * 7)
            continue
        tiles = g["template_launch"]
        rows.append(
            shape
            + [_f(g["library"]["median_s"], 1e6), _f(g["template"]["median_s"], 1e6)]
            + [_f(g.get("template_predicted_s"), 1e6)]
            + [_f(g["library_tflops"]), _f(g["template_tflops"])]
            + [_f(g["template_vs_library"])]
            + [
                f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']}x{tiles['BLOCK_K']} "
                f"w{tiles['num_warps']} s{tiles['num_stages']}"
            ]
            + [f"{_f(g['template_rel_error'])} / {_f(g['library_rel_error'])}"]
        )
    lines = [
        "template / cuBLAS > 1: the template is faster (each timed alone, cold L2). "
        "`decode` rows: a row against an nn.Linear weight (F.linear); the others torch.mm. "
        "predicted: the cost model's time of the template's launch (not replayed)."
    ]
    return (
        lines
        + _table(head, rows)
        + _gemm_reductions(r.get("rows", []))
        + _gemm_variants(r.get("rows", []))
    )


def _gemm_reductions(rows: list[dict[str, Any]]) -> list[str]:
    """The one-row products as sum reductions (the option ``gemv_reduction``)."""
    head = ["M", "N", "K", "reduction us", "predicted us", "template us", "cuBLAS us"]
    head += ["tiles", "rel. error"]
    table = [
        [g["m"], g["n"], g["k"], _f(g["reduction"]["median_s"], 1e6)]
        + [_f(g["reduction_predicted_s"], 1e6), _f(g["template"]["median_s"], 1e6)]
        + [_f(g["library"]["median_s"], 1e6)]
        + [" ".join(f"{k}={v}" for k, v in g["reduction_launch"].items())]
        + [_f(g["reduction_rel_error"])]
        for g in rows
        if "reduction" in g
    ]
    if not table:
        return []
    return [
        "",
        "The one-row products as sum reductions (option gemv_reduction), each timed alone:",
        "",
        *_table(head, table),
    ]


def _gemm_variants(rows: list[dict[str, Any]]) -> list[str]:
    """The decode products' template relaunched with other 16-row tiles."""
    head = ["M", "N", "K", "BLOCK_N", "BLOCK_K", "warps", "stages", "K steps", "programs"]
    head += ["us", "us per K step", "max difference from the template's result"]
    table = []
    for g in rows:
        for v in g.get("variants") or []:
            config = [g["m"], g["n"], g["k"], *v["config"], v["steps"]]
            if "error" in v:
                table.append(config + ["", "error: " + v["error"][:80], "", ""])
                continue
            median = v["median_s"]
            timing = [v["programs"], _f(median, 1e6), _f(median / v["steps"], 1e6)]
            table.append(config + timing + [_f(v["max_abs_diff"])])
    if not table:
        return []
    return [
        "",
        "The decode products' template relaunched with other 16-row tiles (the same "
        "source), each timed alone:",
        "",
        *_table(head, table),
    ]


def _attention(r: dict[str, Any]) -> list[str]:
    head = ["batch x heads x seq x dim", "SDPA us", "template us", "predicted us"]
    head += ["template / SDPA", "template TFLOP/s (full square)", "SDPA TFLOP/s (causal)"]
    head += ["tiles", "max error template / SDPA"]
    rows = []
    for a in r.get("rows", []):
        shape = "x".join(str(d) for d in a["shape"])
        if "error" in a:
            rows.append([shape, "error: " + a["error"].strip().splitlines()[-1][:80]] + [""] * 7)
            continue
        tiles = a["template_launch"]
        rows.append(
            [shape, _f(a["library"]["median_s"], 1e6), _f(a["template"]["median_s"], 1e6)]
            + [_f(a["predicted_s"], 1e6), _f(a["template_vs_library"])]
            + [_f(a["template_tflops_full_square"]), _f(a["library_tflops_causal"])]
            + [f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']} w{tiles['num_warps']}"]
            + [f"{_f(a['template_max_error'])} / {_f(a['library_max_error'])}"]
        )
    lines = [
        "Causal attention, each timed alone (cold L2).  template / SDPA > 1: the template is "
        "faster.  Errors against float32 SDPA."
    ]
    return _attention_decode(r) + lines + _table(head, rows) + _attention_backward(r)


def _attention_decode(r: dict[str, Any]) -> list[str]:
    """The decode rows: the split kernel by its chunks, against its prediction."""
    head = ["batch x q heads x kv heads x keys x dim", "chunks asked", "programs"]
    head += ["key blocks a program", "split kernel us", "predicted us", "max error"]
    rows = []
    for a in r.get("decode", []):
        shape = "x".join(str(d) for d in a["shape"])
        asked = "model" if a["chunks"] is None else a["chunks"]
        if "error" in a:
            rows.append([shape, asked, "error: " + a["error"].strip().splitlines()[-1][:80]])
            rows[-1] += [""] * 4
            continue
        rows.append(
            [shape, asked, math.prod(a["launch"]["grid"]), a["key_blocks"]]
            + [_f(a["split"]["median_s"], 1e6), _f(a["predicted_s"], 1e6), _f(a["max_error"])]
        )
    if not rows:
        return []
    slope = r.get("key_block_s")
    fitted = "not fitted" if slope is None else f"{slope * 1e6:.3f} us"
    return (
        [
            "Decode: one query row of grouped-query attention (keys expanded as transformers' "
            "repeat_kv) split into chunks (the option attention_chunks; model: the cost model's "
            "choice), the split kernel timed alone.  The cost model prices a key block at a "
            f"GEMV's K step (cost.KEY_STEPS); the slope over the one-wave rows: {fitted} a block.",
        ]
        + _table(head, rows)
        + [""]
    )


def _attention_backward(r: dict[str, Any]) -> list[str]:
    """The backward kernels against SDPA's backward, where they were measured."""
    head = ["batch x heads x seq x dim", "SDPA backward us", "template us (dq + dk/dv)"]
    head += ["predicted us", "template / SDPA", "max error dq, dk, dv (SDPA's)"]
    rows = []
    for a in r.get("rows", []):
        b = a.get("backward")
        if not b or "skipped" in b:
            continue
        shape = "x".join(str(d) for d in a["shape"])
        if "error" in b:
            rows.append([shape, "error: " + b["error"].strip().splitlines()[-1][:80]] + [""] * 4)
            continue
        errors = ", ".join(
            f"{_f(ours)} ({_f(theirs)})"
            for ours, theirs in zip(b["max_error"], b["library_max_error"])
        )
        rows.append(
            [shape, _f(b["library_s"], 1e6), _f(b["template_s"], 1e6), _f(b["predicted_s"], 1e6)]
            + [_f(b["template_vs_library"]), errors]
        )
    if not rows:
        return []
    return [
        "",
        "Backward: the two kernels each timed alone; SDPA's forward + backward less its forward.",
    ] + _table(head, rows)


def _launch(r: dict[str, Any]) -> list[str]:
    rows = [
        [
            r2["graphs"],
            r2.get("direct", False),
            r2.get("pdl", False),
            r2.get("chain", False),
            r2["launches"],
            _f(r2["median_s"], 1e6, ".1f"),
            r2["capture"],
            _launch_paths(r2),
        ]
        for r2 in r.get("rows", [])
    ]
    head = [
        "CUDA graphs",
        "direct",
        "pdl",
        "chain",
        "launches",
        "us per call",
        "graph capture",
        "launched",
    ]
    return _table(head, rows) + [
        "",
        f"- per launch, program call (Triton JIT launches): {_f(r.get('jit_us_per_launch'), 1, '.2f')} us",
        f"- per launch, program call (direct launches): {_f(r.get('direct_us_per_launch'), 1, '.2f')} us",
        f"- per launch, graph replay: {_f(r.get('graph_us_per_launch'), 1, '.2f')} us",
        "- per launch, graph replay with programmatic dependent launch: "
        + (
            f"{_f(r.get('pdl_graph_us_per_launch'), 1, '.2f')} us"
            if "pdl_skipped" not in r
            else f"not measured ({r['pdl_skipped']})"
        ),
        "- per stage of a chained kernel, graph replay (the cost model's `chain_wait_s`): "
        f"{_f(r.get('chain_graph_us_per_stage'), 1, '.2f')} us",
    ]


def _launch_paths(row: dict[str, Any]) -> str:
    """How a row's launches went: direct / JIT counts, and whether the
    direct program's results equal the JIT's."""
    same = {True: "equal", False: "DIFFERENT", None: "-"}[row.get("equal_to_jit")]
    if row.get("pdl"):
        return f"replay, pdl, results {same} to JIT"
    if row.get("chain"):
        return f"replay, chained, results {same} to JIT"
    if not row.get("direct"):
        return "JIT" if not row["graphs"] else "replay"
    counts = row.get("launch_counts", {})
    return f"{counts.get('direct', 0)} direct / {counts.get('jit', 0)} JIT, results {same} to JIT"


def _kernels(r: dict[str, Any], ceilings: dict[str, Any]) -> list[str]:
    bandwidth = ceilings.get("bandwidth_bytes_per_s")
    summary = r.get("summary") or {}
    lines = [
        f"{summary.get('kernels', 0)} kernel sources, each timed alone at its first launch "
        f"(cold L2); median |ln(measured / "
        f"predicted)| = {_f(summary.get('median_abs_log_error'), 1, '.2f')}, median measured / "
        f"predicted = {_f(summary.get('median_measured_over_predicted'), 1, '.2f')}. "
        "Prediction: `gpu_check.predicted_seconds`.",
        "",
    ]
    head = [
        "model",
        "kernel (launches)",
        "template",
        "bytes",
        "flops",
        "measured us",
        "predicted us",
    ]
    head += ["measured / predicted", "% copy bandwidth"]
    rows = []
    for name, m in r.get("models", {}).items():
        if "error" in m:
            rows.append([name, "error: " + m["error"].strip().splitlines()[-1][:80]] + [""] * 7)
        for k in m.get("kernels", []):
            share = bandwidth and k["bytes"] / k["measured_s"] / bandwidth
            rows.append(
                [name, f"{k['graph']}:{k['kernel']} ({k['launches']})", k["template"]]
                + [k["bytes"], k["flops"]]
                + [_f(k["measured_s"], 1e6, ".1f"), _f(k["predicted_s"], 1e6, ".1f")]
                + [_f(k["measured_over_predicted"], 1, ".2f"), _f(share, 100, ".0f")]
            )
    return lines + _table(head, rows)


def _zoo(r: dict[str, Any], report: dict[str, Any]) -> list[str]:
    if not r.get("results"):
        return ["no measurements"]
    zoo = {**report, "accuracy_rule": r["accuracy_rule"], "results": r["results"]}
    table = markdown_table(zoo).replace("# Model zoo", "Model zoo", 1)
    skipped = [
        f"- skipped {s['model']} {s['backend']}: {s['reason']}" for s in r.get("skipped", [])
    ]
    return [table, *skipped]


def _decode(r: dict[str, Any]) -> list[str]:
    head = ["model", "cache", "backend", "tokens/s", "first generate s", "programs"]
    head += ["same tokens as eager", "fallbacks"]
    rows = []
    for d in r.get("results", []):
        where = [d["model"], d["cache"], d["backend"]]
        if "error" in d:
            rows.append(where + ["error: " + d["error"].strip().splitlines()[-1][:80]] + [""] * 4)
            continue
        fallbacks = "" if d["fallbacks"] is None else sum(d["fallbacks"].values())
        rows.append(
            where
            + [_f(d["tokens_per_s"], 1, ".1f"), _f(d["first_generate_s"], 1, ".1f")]
            + [d["programs"], d["same_tokens"], fallbacks]
        )
    skipped = [
        f"- skipped {s['model']} {s['cache']} {s['backend']}: {s['reason']}"
        for s in r.get("skipped", [])
    ]
    return _table(head, rows) + skipped


# A decode step row's options, after its scheme the tables' first columns.
SETTINGS = ("pdl", "split_combine", "gemv_reduction", "chain")
SETTINGS_HEAD = ["scheme", *SETTINGS]


def _settings(d: dict[str, Any]) -> list[Any]:
    """A decode step row's scheme and options (absent: off)."""
    return [d["scheme"], *(d.get(name, False) for name in SETTINGS)]


def _decode_step(r: dict[str, Any]) -> list[str]:
    head = [*SETTINGS_HEAD, "launches", "tok/s replay", "tok/s call"]
    head += ["tok/s predicted"]
    head += ["measured / predicted", "tok/s limit", "argmax as eager", "graph capture"]
    rows = []
    for d in r.get("rows", []):
        if "error" in d:
            error = "error: " + d["error"].strip().splitlines()[-1][:80]
            rows.append([*_settings(d), error] + [""] * 7)
            continue
        rows.append(
            [*_settings(d), d["launches"]]
            + [_f(d[k], 1, ".0f") for k in ("tokens_per_s_replay", "tokens_per_s_call")]
            + [_f(d["tokens_per_s_predicted"], 1, ".0f"), _f(d["measured_over_predicted"])]
            + [_f(d["tokens_per_s_limit"], 1, ".0f"), d["argmax_equal_to_eager"], d["capture"]]
        )
    lines = [
        f"Model {r.get('shape')}, static cache {r.get('cache')}, batch {r.get('batch')}, "
        f"{r.get('dtype')}; predicted for the {r.get('predicted_for')} "
        "(benchmarks/static_decode.py's pricing of the same program's kernels).",
        "",
        *_table(head, rows),
    ]
    ratios = r.get("ratios") or {}
    if ratios:
        lines += [""] + [
            f"- {key}: measured {_f(v['measured'], 1, '.2f')}x, predicted "
            f"{_f(v['predicted'], 1, '.2f')}x"
            for key, v in sorted(ratios.items())
        ]
    return lines + _step_kernels(r.get("rows", []))


# Launches of a decode step listed in the report, costliest first.
KERNELS_LISTED = 12


def _step_kernels(rows: list[dict[str, Any]]) -> list[str]:
    """Per row, the step's kernels timed alone, summed per kind; the first
    row's costliest kernels."""
    timed = [d for d in rows if d.get("by_template")]
    if not timed:
        return []
    lines = [
        "",
        "Each launch timed alone (uncaptured, CUDA events around each; library calls "
        "not timed), summed per kind of kernel against the predicted replay:",
        "",
    ]
    head = [*SETTINGS_HEAD, "kind", "launches", "measured us"]
    head += ["predicted us", "measured / predicted"]
    table = [
        [*_settings(d), kind, v["launches"]]
        + [_f(v["measured_s"], 1e6, ".1f"), _f(v["predicted_s"], 1e6, ".1f")]
        + [_f(v["measured_s"] / v["predicted_s"]) if v["predicted_s"] else ""]
        for d in timed
        for kind, v in d["by_template"].items()
    ]
    first = timed[0]
    head2 = ["kernel", "kind", "grid", "bytes", "measured us", "predicted us"]
    costliest = [
        [k["kernel"], k["template"], k["grid"], k["bytes"]]
        + [_f(k["measured_s"], 1e6, ".1f"), _f(k["predicted_s"], 1e6, ".1f")]
        for k in first["kernels"][:KERNELS_LISTED]
    ]
    return [
        *lines,
        *_table(head, table),
        "",
        f"The {first['scheme']} row's costliest launches ({len(costliest)} of "
        f"{len(first['kernels'])}; all in results.json):",
        "",
        *_table(head2, costliest),
    ]


TITLES = {
    "tests": "1. `gpu` test tier",
    "ceilings": "2. Ceilings",
    "gemms": "3. GEMMs: cuBLAS vs tilec's Triton template",
    "launch": "4. Launch cost",
    "kernels": "5. Kernels vs prediction",
    "zoo": "6. Zoo at batch 1",
    "decode": "7. Decode",
    "attention": "8. Attention: tilec's template vs torch's SDPA",
    "decode_step": "9. The static decode report's step, measured",
}


def markdown(report: dict[str, Any]) -> str:
    """The summary of a ``gpu_check`` report dict."""
    cfg = report["config"]
    lines = [f"# GPU check: {report['device']}", ""]
    lines += [DRY_RUN_NOTICE, ""] if report["dry_run"] else []
    lines += [
        f"torch {report['torch']}, triton {report['triton']}, "
        f"transformers {report.get('transformers')}, {report['date']}",
        f"command: `{report['command']}`",
        f"{cfg['size']} models, batch 1, {cfg['dtype']}; {cfg['runs']} timed runs after "
        f"{cfg['warmup']} warm-up, median; {report.get('seconds', 0):.0f} s of a "
        f"{report['budget_s']:.0f} s budget. Raw numbers: results.json.",
    ]
    ceilings = report["sections"].get("ceilings", {})
    render: dict[str, Callable[[dict[str, Any]], list[str]]] = {
        "tests": _tests,
        "ceilings": _ceilings,
        "gemms": _gemms,
        "launch": _launch,
        "kernels": lambda r: _kernels(r, ceilings),
        "zoo": lambda r: _zoo(r, report),
        "decode": _decode,
        "attention": _attention,
        "decode_step": _decode_step,
    }
    for name, r in report["sections"].items():
        lines += ["", f"## {TITLES[name]}", ""]
        lines.append(f"status: {r['status']}, {r['seconds']:.0f} s of {r['budget_s']:.0f} s")
        if r.get("skipped_for_time"):
            lines.append(f"skipped for time: {', '.join(r['skipped_for_time'])}")
        lines.append("")
        if r["status"] in ("ok", "partial", "timeout"):  # a timeout keeps what it saved
            lines += render[name](r)
        if "error" in r:
            lines += ["```", r["error"].strip()[-3000:], "```"]
        if "log_tail" in r:
            lines += ["last output:", "```", r["log_tail"].strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"
