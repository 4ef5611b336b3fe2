"""Tables and plots of a zoo run (``benchmarks/run.py``'s report dict)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def _by_case(report: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """(model, mode, dtype) -> backend -> result."""
    cases: dict = defaultdict(dict)
    for r in report["results"]:
        cases[(r["model"], r["mode"], r["dtype"])][r["backend"]] = r
    return cases


def speedup(case: dict[str, dict[str, Any]], backend: str) -> float | None:
    """Eager's median latency over ``backend``'s, when both ran."""
    eager, other = case.get("eager", {}), case.get(backend, {})
    if "median_s" not in eager or "median_s" not in other:
        return None
    return eager["median_s"] / other["median_s"]


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(report: dict[str, Any]) -> str:
    backends = list(dict.fromkeys(r["backend"] for r in report["results"]))
    compiled = [b for b in backends if b != "eager"]
    # The timing method of the runs that were timed (a failed run has none).
    timings = sorted({r["timing"] for r in report["results"] if "timing" in r})
    unit = ", ".join(["ms", *timings])
    head = ["model", "mode", "dtype", "source"]
    head += [f"{b} latency" for b in backends]
    head += [f"{b} speedup" for b in compiled]
    head += ["tilec / inductor"] if {"tilec", "inductor"} <= set(backends) else []
    head += [f"{b} compile s" for b in compiled] + [f"{b} kernels" for b in compiled]
    head += ["tilec fallbacks", "accurate"]
    lines = [
        f"# Model zoo on {report['device']} ({report['device_kind']})",
        "",
        f"torch {report['torch']}, triton {report['triton']}, {report['date']}",
        f"command: `{report['command']}`",
        f"latency: median ({unit}); speedup: eager latency / backend latency; "
        f"accuracy: {report['accuracy_rule']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    speedups: dict[str, list[float]] = defaultdict(list)
    ratios: list[float] = []
    for (model, mode, dtype), case in _by_case(report).items():
        any_run = next(iter(case.values()))
        row = [model, mode, dtype, any_run.get("source", "-")]
        row += [
            "error"
            if "error" in case.get(b, {})
            else _fmt(case.get(b, {}).get("median_s", None) and case[b]["median_s"] * 1000)
            for b in backends
        ]
        for b in compiled:
            s = speedup(case, b)
            row.append(_fmt(s, ".2f"))
            if s is not None:
                speedups[b].append(s)
        if {"tilec", "inductor"} <= set(backends):
            a, b = speedup(case, "tilec"), speedup(case, "inductor")
            row.append(_fmt(a / b if a and b else None, ".2f"))
            if a and b:
                ratios.append(a / b)
        row += [_fmt(case.get(b, {}).get("compile_s"), ".1f") for b in compiled]
        row += [_fmt(case.get(b, {}).get("kernels"), "d") for b in compiled]
        fallbacks = [
            r["fallbacks"] for b, r in case.items() if b.startswith("tilec") and "fallbacks" in r
        ]
        row.append(_fmt(max(fallbacks) if fallbacks else None, "d"))
        checked = [r["accurate"] for r in case.values() if "accurate" in r]
        errors = [b for b, r in case.items() if "error" in r]
        row.append(
            ("yes" if all(checked) else "NO")
            + (f" (errors: {', '.join(errors)})" if errors else "")
        )
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for b in compiled:
        lines.append(f"geomean speedup over eager, {b}: {_fmt(geomean(speedups[b]), '.3f')}")
    if ratios:
        lines.append(f"geomean tilec / inductor: {_fmt(geomean(ratios), '.3f')}")
    errors = [r for r in report["results"] if "error" in r]
    if errors:
        lines += ["", "errors:"]
        lines += [
            f"- {r['model']} {r['backend']} {r['mode']} {r['dtype']}: {r['error'].splitlines()[0][:300]}"
            for r in errors
        ]
    return "\n".join(lines) + "\n"


def plot_speedups(report: dict[str, Any], path: Path) -> None:
    """Bars of speedup over eager per model, tilec and Inductor side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _by_case(report)
    compiled = [b for b in dict.fromkeys(r["backend"] for r in report["results"]) if b != "eager"]
    labels = [
        f"{m}\n{mode[:5]} {dt}" if len({k[1:] for k in cases}) > 1 else m for m, mode, dt in cases
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cases) + 2), 4.5))
    width = 0.8 / max(len(compiled), 1)
    for k, b in enumerate(compiled):
        values = [speedup(case, b) or 0.0 for case in cases.values()]
        xs = [i + (k - (len(compiled) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, values, width, label=b)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("speedup over eager, log scale (higher is better)")
    title = f"{report['device']} ({report['device_kind']})"
    if report["device_kind"] == "cpu":
        title += ": CPU timings; tilec's kernels run in the Triton interpreter"
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
