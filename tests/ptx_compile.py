"""Compile one recorded tilec kernel for sm_90 on a machine without a GPU.

Used by ``tests/test_ptx.py``, in worker processes: a kernel module must be
imported with ``TRITON_INTERPRET=0`` for its ``@triton.jit`` function to be
compilable, and Triton's compile is CPU-bound, so two processes halve the time.
"""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tilec.codegen.cache import load_module, write_source

TARGET = GPUTarget("cuda", 90, 32)
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def compile_kernel(entry: dict[str, Any]) -> dict[str, Any]:
    """Compile a kernel recorded by :mod:`tilec.codegen.record`.

    Returns ``ok``, ``error`` (the compiler's message), ``ptx`` (its size in
    bytes) and, when ptxas reported them, ``spill_bytes`` and ``registers``.
    """
    path = write_source(entry["source"])
    result: dict[str, Any] = {"name": entry["name"], "path": str(path), "ok": False}
    try:
        fn = getattr(load_module(path, interpret=False), entry["name"])
        signature = {**entry["signature"], "XBLOCK": "constexpr", "RBLOCK": "constexpr"}
        source = ASTSource(
            fn,
            signature=signature,
            constexprs={"XBLOCK": entry["xblock"], "RBLOCK": entry["rblock"]},
        )
        log = io.StringIO()
        # ptxas always runs with -v; this knob prints its log (registers, spills).
        with _ptxas_log(), contextlib.redirect_stdout(log):
            compiled = triton.compile(
                source, target=TARGET, options={"num_warps": entry["num_warps"]}
            )
    except Exception as e:  # the report names every failing kernel, not just the first
        result["error"] = f"{type(e).__name__}: {e}"[-3000:]
        return result
    result["ok"] = True
    result["ptx"] = len(compiled.asm.get("ptx", ""))
    text = log.getvalue()
    spills = _SPILLS.findall(text)
    if spills:
        result["spill_bytes"] = sum(int(s) + int(ld) for s, ld in spills)
    registers = _REGISTERS.findall(text)
    if registers:
        result["registers"] = max(int(r) for r in registers)
    return result


@contextlib.contextmanager
def _ptxas_log():
    nvidia = triton.knobs.nvidia
    previous = nvidia.dump_ptxas_log
    nvidia.dump_ptxas_log = True
    try:
        yield
    finally:
        nvidia.dump_ptxas_log = previous
