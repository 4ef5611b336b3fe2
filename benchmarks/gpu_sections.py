"""A section of ``python -m benchmarks.gpu_check`` in its own process:

    python -m benchmarks.gpu_sections NAME CONFIG.json RESULT.json

Here are the sections that drive what the project already has (``tests``:
pytest's ``gpu`` tier; ``ceilings``: ``roofline.measure_peaks``; ``zoo``:
``run.py``'s measurement; ``decode``: ``decode.py``); those that time
tilec's programs themselves are in ``gpu_kernels.py``.

``gpu_check`` writes the config (``gpu_check.config``, plus the section's
``deadline``) and reads the result, which a section saves after every item:
a section stopped at its deadline keeps what it measured.  A section starts
no item it has no time left for and names it in ``skipped_for_time``; an
item that fails is recorded with its traceback and the section goes on.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import decode, gpu_attention, gpu_decode, gpu_kernels, roofline, run, static
from benchmarks.gpu_timing import Section, failure, release
from benchmarks.measure import DTYPES

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- 1. tests

_OUTCOME = re.compile(r"^(tests/\S+::\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def gpu_test_files() -> list[str]:
    """The test files that mark a test ``gpu`` (``pytest.mark.gpu``, also as
    a parameter's or a module's mark): collecting only them saves the rest
    of the suite's collection (the OpInfo tier's alone takes seconds)."""
    files = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(f.relative_to(ROOT)) for f in files if "mark.gpu" in f.read_text()]


def tests(s: Section) -> None:
    """The ``gpu`` test tier (``pytest -m gpu`` over :func:`gpu_test_files`),
    in a subprocess."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rfE", "-p", "no:cacheprovider"]
    cmd += gpu_test_files()
    s.data["command"] = shlex.join(["python", *cmd[1:]])
    # A session of its own, so that a timeout also ends what the tests started
    # (the demo's process).
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=max(s.remaining() - 5, 1))
        s.data["exit_code"] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        s.data["timed_out"] = True
    outcomes = _OUTCOME.findall(output)
    counts = {
        kind.lower(): sum(1 for _, o in outcomes if o == kind)
        for kind in set(o for _, o in outcomes)
    }
    s.data["counts"] = {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "error")}
    s.data["failed"] = [name for name, o in outcomes if o in ("FAILED", "ERROR")]
    s.data["summary_lines"] = [
        line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))
    ]
    # 0: all passed; 1: some failed (named above).  Anything else (a file
    # that does not import, no test selected) means the tier did not run.
    ran = s.data.get("exit_code") in (0, 1)
    if s.data["failed"] or s.data.get("timed_out") or not ran:
        s.data["output_tail"] = output[-6000:]
    if not s.data.get("timed_out") and not ran:
        lines = s.data["summary_lines"] or output.strip().splitlines()[-1:]
        raise RuntimeError(
            f"pytest exited with {s.data['exit_code']}: the gpu tier did not run ({lines})"
        )


# ------------------------------------------------------------ 2. ceilings


def ceilings(s: Section) -> None:
    """Copy bandwidth and bf16 matmul rate (``roofline.measure_peaks``), next
    to what the static prediction assumes (``static.CONSTANTS``)."""
    cfg = s.cfg
    peaks = roofline.measure_peaks(s.device, cfg["copy_bytes"], cfg["matmul_n"], cfg["runs"])
    assumed_bw = static.CONSTANTS["memory_bytes_per_s"][0]
    assumed_flops = static.CONSTANTS["gemm_flops_per_s_bf16"][0]
    s.data.update(
        copy_bytes=cfg["copy_bytes"],
        matmul_n=cfg["matmul_n"],
        bandwidth_bytes_per_s=peaks["bandwidth"],
        bf16_flops_per_s=peaks["flops"],
        assumed_bandwidth_bytes_per_s=assumed_bw,
        assumed_bf16_flops_per_s=assumed_flops,
        bandwidth_vs_assumed=peaks["bandwidth"] / assumed_bw,
        flops_vs_assumed=peaks["flops"] / assumed_flops,
    )


# ----------------------------------------------------------------- 6. zoo


def zoo(s: Section) -> None:
    """The zoo at batch 1 through ``benchmarks/run.py``'s measurement, one
    fresh process per (model, backend)."""
    cfg = s.cfg
    s.data.update(accuracy_rule=run.environment(s.device)["accuracy_rule"], results=[], skipped=[])
    for model in cfg["models"]:
        for backend in cfg["backends"]:
            reason = _skip_reason(backend, cfg)
            if reason is not None:
                s.data["skipped"].append({"model": model, "backend": backend, "reason": reason})
                continue
            if s.out_of_time(cfg["item_min_s"], f"{model} {backend}"):
                continue
            spec = {
                "model": model,
                "backend": backend,
                "device": s.device,
                "dtype": cfg["dtype"],
                "mode": "inference",
                "size": cfg["size"],
                "batch": 1,
                "rotations": cfg["max_input_sets"],
                "warmup": cfg["warmup"],
                "runs": cfg["runs"],
            }
            timeout = min(s.remaining() - 2, cfg["timeout_s"])
            s.data["results"].append(run.measure_in_subprocess(spec, timeout))
            s.save()


def _skip_reason(backend: str, cfg: dict[str, Any]) -> str | None:
    reason = decode.skip_reason(backend, cfg["device"])
    if reason is None and backend.startswith("inductor") and cfg["dry_run"]:
        reason = (
            "dry run: Inductor compiles C++ on a CPU (tens of seconds per graph), which says "
            "nothing about its GPU code; the GPU run measures it"
        )
    return reason


# -------------------------------------------------------------- 7. decode


def decode_tokens(s: Section) -> None:
    """Greedy decoding tokens/s through ``benchmarks/decode.py``."""
    cfg = s.cfg
    s.data.update(results=[], skipped=[])
    for name in cfg["models"]:
        torch.manual_seed(0)
        with torch.device(s.device):
            model = decode.decoder(name, cfg["size"]).to(DTYPES[cfg["dtype"]])
        prompt = torch.randint(
            1, model.config.vocab_size, (1, cfg["prompt"]), generator=torch.Generator()
        ).to(s.device)
        for cache in cfg["caches"]:
            eager = None
            for backend in ["eager", *cfg["backends"]]:
                where = {"model": name, "cache": cache, "backend": backend}
                reason = _skip_reason(backend, cfg)
                if reason is not None:
                    s.data["skipped"].append({**where, "reason": reason})
                    continue
                if s.out_of_time(cfg["item_min_s"], f"{name} {cache} {backend}"):
                    continue
                try:
                    row = decode.run_backend(
                        model, prompt, cache, cfg["new_tokens"], backend, cfg["runs"], s.device
                    )
                except Exception:
                    row = {"backend": backend, "error": failure()}
                eager = row if backend == "eager" else eager
                same = eager is not None and row.get("tokens") == eager.get("tokens")
                s.data["results"].append({**where, **row, "same_tokens": same and "tokens" in row})
                s.save()
        del model
        release()


SECTIONS = {
    "tests": tests,
    "ceilings": ceilings,
    "gemms": gpu_kernels.gemms,
    "launch": gpu_kernels.launch,
    "kernels": gpu_kernels.kernels,
    "zoo": zoo,
    "decode": decode_tokens,
    "attention": gpu_attention.attention,
    "decode_step": gpu_decode.decode_step,
}


def main(argv: list[str] | None = None) -> int:
    name, config_path, result_path = argv or sys.argv[1:]
    section = Section(json.loads(Path(config_path).read_text()), Path(result_path))
    torch.backends.mha.set_fastpath_enabled(False)  # the real graph, not one fused op
    try:
        SECTIONS[name](section)
        section.data["status"] = "partial" if section.data.get("skipped_for_time") else "ok"
    except Exception:
        section.data.update(status="error", error=failure())
    section.save()
    print(f"{name}: {section.data['status']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
