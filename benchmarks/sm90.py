"""Compile one tilec kernel for sm_90 (H100) on a machine without a GPU.

Used by the PTX test tier (``tests/test_ptx.py``) and the static report
(``benchmarks/static.py``), in worker processes: a kernel module must be
imported with ``TRITON_INTERPRET=0`` for its ``@triton.jit`` function to be
compilable, and Triton's compile is CPU-bound.

The compile sees what a real launch would: Triton specializes a launch on
pointer arguments that are 16-byte aligned and int arguments divisible by 16
(``tt.divisibility``), and tilec's buffers are 256-byte aligned (the arena) or
come from torch's allocator (512-byte aligned).  Without those attributes the
GPU compiler sees unaligned pointers and emits scalar loads only: code that
never runs.
"""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tilec import cost
from tilec.codegen.cache import load_module, write_source
from tilec.codegen.launch import CHECKED
from tilec.target import Target

# The GPU every kernel is compiled for, and its limits (occupancy).
H100 = Target.named("h100-sxm")


def triton_target(target: Target) -> GPUTarget:
    """Triton's name for the CUDA GPU ``target`` (``GPUTarget("cuda", 90, 32)``
    for an H100)."""
    if target.capability is None:
        raise ValueError(f"tilec: {target.name} is not a CUDA GPU")
    major, minor = target.capability
    return GPUTarget("cuda", 10 * major + minor, target.warp_size)


TARGET = triton_target(H100)
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
# A global load or store in PTX: ld.global[.nc...][.v2|.v4].<type><bits>.
_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z]\w*)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
# cp.async.{ca,cg}.shared.global [dst], [src], bytes(, src-size)?;
_ASYNC_COPY = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\s*\[[^]]*\],\s*\[[^]]*\],\s*(\w+)")


def specializations(signature: dict[str, str], divisible: set[str]) -> dict:
    """``tt.divisibility`` attributes a real launch gets: every pointer (tilec's
    buffers are aligned), and the int arguments named in ``divisible``."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, (arg, kind) in enumerate(signature.items())
        if kind.startswith("*") or arg in divisible
    }


def vector_accesses(ptx: str) -> dict[str, int]:
    """Global loads and stores in ``ptx`` (static instruction counts), how
    many of each move 128 bits at once and how many loads move one byte; and
    the asynchronous copies from global to shared memory (``copies``: how
    Triton's software pipeline loads a ``tl.dot`` operand), with those that
    move 16 bytes at once."""
    counts = {"loads": 0, "loads_128": 0, "loads_8": 0, "stores": 0, "stores_128": 0}
    for op, vector, bits in _GLOBAL_ACCESS.findall(ptx):
        kind = "loads" if op == "ld" else "stores"
        counts[kind] += 1
        width = int(vector or 1) * int(bits)
        if width == 128:
            counts[f"{kind}_128"] += 1
        if kind == "loads" and width == 8:
            counts["loads_8"] += 1
    copies = [int(size, 0) for size in _ASYNC_COPY.findall(ptx)]
    counts["copies"], counts["copies_128"] = len(copies), copies.count(16)
    return counts


# A loop's header block in LLVM's PTX (``$L__BB0_1: // =>This Inner Loop
# Header``), and a branch to a label.
# A loop's first block: its label, the block's name as a comment where LLVM
# gives one (``// %.lr.ph``), then LLVM's loop comment.
_LOOP_HEADER = re.compile(
    r"^(\$L__BB\w+):(?:[ \t]*//[^\n]*)?\s*//\s*=>This Inner Loop Header", re.MULTILINE
)
# A global load, and the register its address is in (None for a symbol's).
_GLOBAL_LOAD = re.compile(r"\bld\.global\b[^\[;]*\[\s*(%\w+)?")
# An instruction writing a register from others (``add.s64 %rd3, %rd1, %rd2;``),
# or from a symbol (``mov.b64 %rd1, __cudart_i2opi_f;``).
_DEFINITION = re.compile(r"^\s*([\w.]+)\s+(%\w+),\s*([^;]*);", re.MULTILINE)
_REGISTER = re.compile(r"%\w+")
# Constant tables of CUDA's math library (libdevice): ``__cudart_i2opi_f``,
# the bits of 2/pi that sin and cos reduce a large argument with.
_LIBRARY_TABLE = re.compile(r"\b__cudart_\w+")


def library_table_registers(ptx: str) -> set[str]:
    """Registers of ``ptx`` that hold an address computed from a constant
    table of CUDA's math library (any instruction writing one from such a
    table or such a register; a value loaded from a table is not an address)."""
    definitions = [
        (m.group(2), m.group(3))
        for m in _DEFINITION.finditer(ptx)
        if not m.group(1).startswith("ld.")
    ]
    found: set[str] = set()
    while True:
        more = {
            dest
            for dest, sources in definitions
            if dest not in found
            and (_LIBRARY_TABLE.search(sources) or found & set(_REGISTER.findall(sources)))
        }
        if not more:
            return found
        found |= more


def loop_loads(ptx: str) -> int:
    """Global loads inside ``ptx``'s loops (static count, from each loop's
    header to its last branch back): loads a loop waits for every
    iteration, where Triton's pipeliner copies a loop's loads ahead
    asynchronously (``cp.async``, not counted).  A GEMM's K loop with such
    a load takes a memory round trip per step (``cost.k_loop_seconds``).
    Not counted either: loads of CUDA's math library's constant tables
    (:func:`library_table_registers`), in loops of its own (sin and cos
    reduce an argument of magnitude over about 1e5 in one, reading the
    bits of 2/pi), which are not the kernel's loops."""
    tables = library_table_registers(ptx)
    lines: set[int] = set()
    for header in _LOOP_HEADER.finditer(ptx):
        branch = re.compile(rf"\bbra(?:\.uni)?\s+{re.escape(header.group(1))};")
        ends = [m.start() for m in branch.finditer(ptx, header.end())]
        if ends:
            loads = _GLOBAL_LOAD.finditer(ptx, header.end(), ends[-1])
            lines |= {m.start() for m in loads if m.group(1) not in tables}
    return len(lines)


# The first access to global memory in PTX: a load, store, atomic or
# reduction on the global state space, or an asynchronous copy from it.
_FIRST_MEMORY = re.compile(r"\b(?:ld|st|atom|red)\.global|\bcp\.async")


def waits_first(ptx: str) -> bool:
    """Whether ``ptx`` waits for the kernel it follows (``griddepcontrol.wait``,
    programmatic dependent launch) before its first access to global memory:
    what makes such a launch keep the stream's order."""
    wait = ptx.find("griddepcontrol.wait")
    first = _FIRST_MEMORY.search(ptx)
    return wait >= 0 and (first is None or wait < first.start())


# A global atomic with release semantics at GPU scope (``atom.global.gpu
# .acq_rel``, ``.release``), and what comes between it and the last global
# store before it.
_RELEASE = re.compile(r"\batom\.global\.gpu\.(?:acq_rel|release)\.")
_STORE = re.compile(r"\bst\.global")


def publishes_after_barrier(ptx: str) -> bool | None:
    """Whether every release atomic in ``ptx`` (a split attention's counter,
    ``codegen/attention.py``) follows a CTA barrier (``bar.sync``) that
    follows the last global store before it: so every thread's stores
    come before the one thread's release that publishes them.  None
    without such an atomic."""
    releases = list(_RELEASE.finditer(ptx))
    if not releases:
        return None
    for release in releases:
        before = ptx[: release.start()]
        stores = list(_STORE.finditer(before))
        last_store = stores[-1].start() if stores else -1
        if before.rfind("bar.sync") < last_store:
            return False
    return True


def occupancy(registers: int, num_warps: int, shared: int, target: Target = H100) -> float:
    """Theoretical occupancy on an SM of ``target``: resident warps over the
    most it holds (64 on an H100)."""
    blocks = cost.resident_programs(target, shared, num_warps, registers)
    return blocks * num_warps / target.max_warps_per_sm


def compile_kernel(entry: dict[str, Any]) -> dict[str, Any]:
    """Compile a kernel recorded by :mod:`tilec.codegen.record` for sm_90.

    ``entry["divisible"]`` (optional) names the int arguments the launch
    specializes as divisible by 16.  Returns ``ok``, ``error`` (the compiler's
    message), ``ptx`` (its size in bytes), ``shared`` (bytes), the global
    access counts of :func:`vector_accesses` and, when ptxas reported them,
    ``spill_bytes``, ``registers`` and ``occupancy``; ``loop_loads``
    (:func:`loop_loads`); for a kernel launched
    with programmatic dependent launch (``entry["launch_pdl"]``),
    ``waits_first`` (:func:`waits_first`); for one with release atomics,
    ``publishes_after_barrier`` (:func:`publishes_after_barrier`).
    """
    path = write_source(entry["source"])
    result: dict[str, Any] = {"name": entry["name"], "path": str(path), "ok": False}
    try:
        fn = getattr(load_module(path, interpret=False), entry["name"])
        constexprs = entry["constexprs"]
        signature = {**entry["signature"], **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(
            fn,
            signature=signature,
            constexprs=constexprs,
            attrs=specializations(entry["signature"], set(entry.get("divisible", ()))),
        )
        log = io.StringIO()
        # ptxas always runs with -v; this knob prints its log (registers, spills).
        with _ptxas_log(), contextlib.redirect_stdout(log):
            options = {
                "num_warps": entry["num_warps"],
                "num_stages": entry["num_stages"],
                "launch_pdl": entry.get("launch_pdl", False),
                **CHECKED,
            }
            compiled = triton.compile(source, target=TARGET, options=options)
    except Exception as e:  # the report names every failing kernel, not just the first
        result["error"] = f"{type(e).__name__}: {e}"[-3000:]
        return result
    ptx = compiled.asm.get("ptx", "")
    result.update(ok=True, ptx=len(ptx), shared=compiled.metadata.shared, **vector_accesses(ptx))
    result["loop_loads"] = loop_loads(ptx)
    # Device asserts kept (``launch.CHECKED``): calls of CUDA's assert handler.
    result["asserts"] = ptx.count("call.uni __assertfail")
    if entry.get("launch_pdl"):
        result["waits_first"] = waits_first(ptx)
    published = publishes_after_barrier(ptx)
    if published is not None:
        result["publishes_after_barrier"] = published
    text = log.getvalue()
    spills = _SPILLS.findall(text)
    if spills:
        result["spill_bytes"] = sum(int(s) + int(ld) for s, ld in spills)
    registers = _REGISTERS.findall(text)
    if registers:
        result["registers"] = max(int(r) for r in registers)
        result["occupancy"] = occupancy(result["registers"], entry["num_warps"], result["shared"])
    return result


@contextlib.contextmanager
def _ptxas_log():
    """ptxas's log printed, and ptxas run: a kernel found in Triton's cache
    is compiled again, or its registers and spills would go unreported."""
    nvidia, compilation = triton.knobs.nvidia, triton.knobs.compilation
    previous = nvidia.dump_ptxas_log, compilation.always_compile
    nvidia.dump_ptxas_log = compilation.always_compile = True
    try:
        yield
    finally:
        nvidia.dump_ptxas_log, compilation.always_compile = previous
