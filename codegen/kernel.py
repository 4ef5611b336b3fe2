"""One fused group -> the source of one Triton kernel.

:func:`write_kernel` runs the pieces in order: a tiling template
(``codegen/templates.py``) writes the body with the expression emitter
(``codegen/emit.py``) and chooses the launch (``codegen/launch.py``); the
metrics (``codegen/metrics.py``) are counted from what the body computes;
this module assembles the source, names the function by its content and
returns everything as a :class:`KernelSource`.

The source does not depend on the graph's names: parameters are positional
(``in0.., out0.., size0..`` by first use), so identical kernels (the same op
in every layer) have one source, one cache file and one compiled function.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import itertools
import re

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.codegen.emit import KernelArg
from tilec.codegen.launch import DEPENDENT_START, LaunchConfig
from tilec.codegen.metrics import kernel_metrics
from tilec.codegen.templates import tile
from tilec.codegen.triton_ops import prelude_for
from tilec.ir import Graph, Group
from tilec.passes.chain import sync_name
from tilec.target import Target


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """Generated source plus what the runtime needs to launch it."""

    # ``name`` tells kernels apart in dumps and reports (``tilec_k3``: the
    # group's); ``function``, the @triton.jit function in ``source``, is named
    # by content, so identical kernels share one source.
    name: str
    function: str
    group: Group
    source: str
    args: tuple[KernelArg, ...]
    # Parameter names: one per arg, then one per size symbol.
    params: tuple[str, ...]
    # Size symbols passed after the tensors, in this order (symbolic graphs).
    sizes: tuple[sympy.Symbol, ...]
    xnumel: ix.Size
    rnumel: ix.Size
    # The tiling template that wrote it: "pointwise", "persistent" or "looped".
    template: str
    launch: LaunchConfig
    # Traffic and work, for roofline reports (see ``codegen/metrics.py``).
    reads: dict[str, int]
    bytes_written: int
    flops: int
    # One program's longest loop, where the template's ``predict`` needs it
    # counted at writing (``TemplateWriter.program_loop``).
    program_loop: cost.KLoop | None = None
    # A chained kernel's stages (``passes/chain.py``), each its parts'
    # kernels as each would be alone, for pricing each stage on its own.
    stages: tuple[tuple[KernelSource, ...], ...] = ()

    @property
    def bytes_read(self) -> int:
        return sum(self.reads.values())


def write_kernel(graph: Graph, group: Group, target: Target, pdl: bool = False) -> KernelSource:
    """``group``'s kernel for ``target``; ``pdl``: launched with programmatic
    dependent launch (the option ``pdl``, on a target that has it), so it
    starts with :data:`~tilec.codegen.launch.DEPENDENT_START`."""
    if group.parts:
        return _write_combined(graph, group, target, pdl)
    return _write_group(graph, group, target, pdl)[0]


def _dependent(lines: list[str], pdl: bool) -> list[str]:
    """A kernel function's body ``lines``, first waiting for the kernel
    before it where it is launched with ``pdl``."""
    return [f"    {line}" for line in DEPENDENT_START] + lines if pdl else lines


def _write_group(
    graph: Graph, group: Group, target: Target, pdl: bool = False
) -> tuple[KernelSource, list[str]]:
    """A group's kernel, and its body's lines (for a combined kernel's parts)."""
    tiled = tile(graph, group, target)
    body = tiled.emitter
    metrics = kernel_metrics(graph, group, body, tiled.recomputed, tiled.reduction_flops)
    # Inputs, then outputs (a stable sort keeps each in first-use order),
    # then sizes: in0, in1, ..., out0, ..., size0, ...
    order = sorted(body.args.values(), key=lambda a: a[1].is_output)
    params = [name for name, _ in order] + list(body.sizes.values())
    constexprs = [f"{name}: tl.constexpr" for name in tiled.launch.constexprs]
    signature = ", ".join([*params, *constexprs])
    lines = _dependent(body.lines, pdl)
    function = _named(signature, lines)
    header = ["@triton.jit", f"def {function}({signature}):"]
    kernel = KernelSource(
        f"tilec_{group.name}",
        function,
        group,
        _source(header + lines),
        tuple(arg for _, arg in order),
        tuple(params),
        tuple(body.sizes),
        tiled.xnumel,
        tiled.rnumel,
        tiled.template,
        dataclasses.replace(tiled.launch, pdl=pdl),
        reads=metrics.reads,
        bytes_written=metrics.bytes_written,
        flops=metrics.flops,
        program_loop=tiled.program_loop,
    )
    return kernel, body.lines


def _named(signature: str, lines: list[str]) -> str:
    """A kernel's function name, by content: identical kernels have one
    source and one cache file."""
    text = "\n".join(lines)
    return "tilec_" + hashlib.sha256(f"{signature}\n{text}".encode()).hexdigest()[:12]


def _source(lines: list[str]) -> str:
    """A kernel's module: the imports, the helpers it calls, then ``lines``."""
    text = "\n".join(lines)
    imports = ["import triton", "import triton.language as tl"]
    if "libdevice." in text:
        imports.append("from triton.language.extra import libdevice")
    return "\n".join(imports) + "\n\n\n" + prelude_for(text) + "\n\n\n" + text + "\n"


PROGRAM = "tl.program_id(0)"


def _dispatch(calls: list[str], lo: int, hi: int, indent: str) -> list[str]:
    """Lines that run ``calls[k]`` for the program in part ``k``'s range, for
    ``k`` in ``[lo, hi)``: parts below the middle one end at ``END{mid - 1}``."""
    if hi - lo == 1:
        return [indent + calls[lo]]
    mid = (lo + hi) // 2
    deeper = indent + "    "
    return [
        f"{indent}if pid < END{mid - 1}:",
        *_dispatch(calls, lo, mid, deeper),
        f"{indent}else:",
        *_dispatch(calls, mid, hi, deeper),
    ]


def _write_combined(graph: Graph, group: Group, target: Target, pdl: bool) -> KernelSource:
    """One kernel running ``group.parts`` side by side (``passes/combine.py``):
    program ``p`` runs the part whose range of programs holds it, as that
    part's own kernel (a @triton.jit function called with its program
    number) would; it finds that part by bisection over the ranges' ends,
    so a kernel of many parts costs each program a few comparisons.  The ranges' ends are constexpr launch parameters
    (``END0``, ...), like the parts' block sizes (``P0_XBLOCK``, ...): they
    depend on the target, the source does not.

    A chain's parts (``group.stages``, ``passes/chain.py``) are its stages'
    parts in order: a program's number is its ticket (the first counter of
    the chain's ``sync`` constant, advanced as the program starts), a part
    of a later stage first waits for the programs of the stages before it
    (``_chain_wait``: the second counter, the programs finished, reaches the
    end of the stage before), and every program counts itself finished as
    it ends (``_chain_done``)."""
    written = [_write_group(graph, part, target) for part in group.parts]
    stage_of = [s for s, count in enumerate(group.stages) for _ in range(count)]
    # What no kernel writes: constants, and inputs not written in place.
    unwritten = (set(graph.constants) | set(graph.inputs)) - set(graph.in_place.values())
    lines: list[str] = []
    defined: set[str] = set()
    params: list[str] = []
    sizes: list[str] = []
    constexprs: dict[str, int] = {}
    calls: list[str] = []
    end = 0
    for k, (part, body) in enumerate(written):
        (programs,) = part.launch.grid
        body = [line.replace(PROGRAM, "program") for line in body]
        stage = stage_of[k] if stage_of else 0
        waits: list[str] = []
        if stage:
            # A later stage's part waits for the stage before, which ends
            # where this stage's first part starts; it loads what no stage
            # writes (the weights) before it waits.
            stable = {n for n, a in zip(part.params, part.args) if a.buffer in unwritten}
            before, after = prefetched(body, stable)
            body = [*before, "    _chain_wait(finished, count)", *after]
            waits = ["sync + 1", f"END{stage_of.index(stage) - 1}"]
        signature = [
            *part.params,
            "program",
            *(["finished", "count"] if waits else []),
            *(f"{c}: tl.constexpr" for c in part.launch.constexprs),
        ]
        # A waiting part's body is its own kernel's rearranged: named anew.
        function = _named(", ".join(signature), body) if waits else part.function
        function += "_part"
        if function not in defined:
            defined.add(function)
            lines += ["@triton.jit", f"def {function}({', '.join(signature)}):", *body, ""]
        own = [f"p{k}_{name}" for name in part.params]  # its args, then its sizes
        blocks = {f"P{k}_{c}": v for c, v in part.launch.constexprs.items()}
        end += programs
        constexprs |= blocks | {f"END{k}": end}
        start = "0" if k == 0 else f"END{k - 1}"
        calls.append(f"{function}({', '.join([*own, f'pid - {start}', *waits, *blocks])})")
        params += own[: len(part.args)]
        sizes += own[len(part.args) :]
    args = tuple(a for p, _ in written for a in p.args)
    first = f"    pid = {PROGRAM}"
    last: list[str] = []
    if group.stages:
        params.append("sync")
        args += (KernelArg(sync_name(group.name), torch.int32, False),)
        first = "    pid = tl.atomic_add(sync, 1, sem='relaxed', scope='gpu')"
        last = [f"    _chain_done(sync, END{len(calls) - 1})"]
    signature = ", ".join([*params, *sizes, *(f"{c}: tl.constexpr" for c in constexprs)])
    body = _dependent([first, *_dispatch(calls, 0, len(calls), "    "), *last], pdl)
    function = _named(signature, lines + body)
    lines += ["@triton.jit", f"def {function}({signature}):", *body]
    parts = [part for part, _ in written]
    reads: dict[str, int] = {}
    for part in parts:
        for buffer, nbytes in part.reads.items():
            reads[buffer] = reads.get(buffer, 0) + nbytes
    # A chain's two counters, read and written: every program's atomics on
    # them meet in L2, so memory sees their 8 bytes once each way.
    counters = 0
    if group.stages:
        counters = reads[sync_name(group.name)] = 8
    launch = LaunchConfig(
        constexprs,
        (end,),
        max(p.launch.num_warps for p in parts),
        max(p.launch.num_stages for p in parts),
        pdl,
    )
    return KernelSource(
        f"tilec_{group.name}",
        function,
        group,
        _source(lines),
        args,
        (*params, *sizes),
        tuple(s for p in parts for s in p.sizes),
        sum(int(p.xnumel) for p in parts),
        0,
        "chained" if group.stages else "combined",
        launch,
        reads=reads,
        bytes_written=sum(p.bytes_written for p in parts) + counters,
        flops=sum(p.flops for p in parts),
        stages=_stages(parts, group.stages),
    )


# Calls that write memory or synchronize: a line that makes one stays
# after a chain's wait.
_EFFECTS = {"store", "debug_barrier", "device_print", "device_assert", "inline_asm_elementwise"}


def prefetched(body: list[str], stable: set[str]) -> tuple[list[str], list[str]]:
    """A chained part's ``body`` lines split into those that may run before
    its wait and the rest, each in their order: assignments (to a name
    assigned nowhere else) that read only pointers in ``stable`` (buffers
    no stage writes: constants, inputs not written in place), names the lines before the wait define,
    and names the body does not assign (parameters, ``tl``, helpers), and
    that store, synchronize and do atomics nowhere.  Index arithmetic,
    weights' loads and their dequantization go first, so that their loads
    are in flight while the program waits."""
    statements = [_statement(line) for line in body]
    assigned = collections.Counter(
        t.id for st in statements if st is not None for t in _targets(st)
    )
    for line, st in zip(body, statements):
        if st is None and line.strip():  # a block's lines (or its header)
            assigned.update(re.findall(r"^\s*(\w+)\s*[-+*/%&|^]?=[^=]", line))
    ready: set[str] = set()
    before, after = [], []
    for line, st in zip(body, statements):
        if st is not None and _ready(st, assigned, ready, stable):
            before.append(line)
            ready.add(st.targets[0].id)
        else:
            after.append(line)
    return before, after


def _statement(line: str) -> ast.stmt | None:
    """A body line's one simple statement (None: a block's header or line,
    a comment)."""
    if not line.startswith("    ") or line.startswith("     "):
        return None
    try:
        (st,) = ast.parse(line.strip()).body
    except (SyntaxError, ValueError):
        return None
    return None if isinstance(st, (ast.For, ast.If, ast.While, ast.With)) else st


def _targets(st: ast.stmt) -> list[ast.Name]:
    targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)]
    return [n for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)]


def _ready(st: ast.stmt, assigned: collections.Counter, ready: set[str], stable: set[str]) -> bool:
    if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
        return False
    target = st.targets[0]
    if not isinstance(target, ast.Name) or assigned[target.id] != 1:
        return False
    for node in ast.walk(st.value):
        if isinstance(node, ast.Name) and node.id in assigned and node.id not in ready:
            return False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id.startswith("_chain"):  # the helpers that synchronize
                return False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in _EFFECTS or name.startswith("atomic"):
                return False
            if name == "load":
                pointers = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
                if pointers - ready - stable:
                    return False
    return True


def _stages(
    parts: list[KernelSource], counts: tuple[int, ...]
) -> tuple[tuple[KernelSource, ...], ...]:
    """``parts`` grouped into stages of ``counts`` parts each."""
    ends = itertools.accumulate(counts)
    return tuple(tuple(parts[end - count : end]) for count, end in zip(counts, ends))


def sizes_in_memory(kernel: KernelSource, positions: tuple[int, ...]) -> tuple[str, str]:
    """``(source, function)`` of ``kernel`` taking its size arguments from
    memory: the pointer arguments, then ``size_values``, a pointer to int32
    sizes of which the kernel's ``k``-th size argument is at ``positions[k]``,
    then its constexprs.  A CUDA graph bakes in a launch's scalar arguments,
    not what its pointers point to, so a graph captured with this function
    runs at whatever sizes are written there before each replay
    (``runtime/executors.py``, :class:`~tilec.runtime.executors.BucketExecutor`).
    The kernel's own function is called, so its body is the same code."""
    pointers = kernel.params[: len(kernel.args)]
    names = kernel.params[len(kernel.args) :]
    constexprs = list(kernel.launch.constexprs)
    function = f"{kernel.function}_sized"
    signature = [*pointers, "size_values", *(f"{c}: tl.constexpr" for c in constexprs)]
    lines = ["@triton.jit", f"def {function}({', '.join(signature)}):"]
    loads = [f"    {name} = tl.load(size_values + {k})" for name, k in zip(names, positions)]
    lines += _dependent(loads, kernel.launch.pdl)
    call = [*pointers, *names, *(f"{c}={c}" for c in constexprs)]
    lines.append(f"    {kernel.function}({', '.join(call)})")
    return kernel.source + "\n\n" + "\n".join(lines) + "\n", function
