"""Chain dependent kernels into one launch (the option ``chain``).

A decode step is a chain of kernels, each reading what the one before it
wrote: a layer of a LLaMA-style model is five (the q/k/v product, the
attention, the output product with the cache write, the gate/up product,
the down product), and at batch 1 each moves a few megabytes, so the
launches between them cost as much as a tenth of the step.  This pass
runs consecutive kernels of the program's order as the stages of one
kernel: its programs take tickets (an atomic counter) in the order they
start, the first stage's programs the first tickets; a program of a later
stage waits until every program of the stages before it has finished (a
second counter, which each program advances as it ends, with release
semantics, and a waiting program reads with acquire semantics), then runs
its part as that part's own kernel would (``codegen/kernel.py``).  A
program waits only for programs with lower tickets, which have started
and so will finish, so the wait cannot deadlock however many programs a
GPU holds at once; the last program to end sets both counters back to 0
for the next launch.  In Triton's interpreter, which runs programs one
after another in order, no program ever waits.

A stage is a kernel a combination could hold (``passes/combine.py``:
static sizes, not a template's, not a scatter's init kernel), or a
combination itself; templates (GEMM, attention), extern calls, library
calls and kernels of symbolic sizes end a chain.  A chain is a run of
consecutive steps of a topological order of the program's steps
(``memory_plan.steps``), so contracting it into one step keeps the order
acyclic, and memory planning treats it as one step (every buffer it
touches is live across it).  The counters are a constant of the graph,
zeros, that the kernel leaves as it found them: so one launch of a
program's chained kernel may run at a time (two in flight at once, from
two streams, would share them; so would a launch after one that a device
error stopped half way), as with ``split_combine``'s counters.  The nodes are unchanged,
so the IR interpreter computes the same graph.

Off by default: whether a wait inside a kernel costs less than a launch
between kernels on a GPU is for ``benchmarks.gpu_check`` to measure
(the ``launch`` section's chained rows); until then the cost model
prices each stage boundary as a replayed launch (``Target.chain_wait_s``).
"""

from __future__ import annotations

import torch

from tilec.ir import Graph, Group, Node
from tilec.passes.combine import MAX_ARGS, arguments, combinable
from tilec.passes.memory_plan import step_order


def sync_name(group: str) -> str:
    """The name of a chain kernel's counters: its tickets, its finished programs."""
    return f"{group}_sync"


def chain(graph: Graph, enabled: bool = False) -> tuple[Graph, dict[str, int]]:
    """``graph`` with runs of consecutive kernels chained (module docstring)."""
    if not enabled or len(graph.groups) < 2:
        return graph, {"chained_kernels": 0}
    _, order = step_order(graph)
    by_name = {g.name: g for g in graph.groups}
    runs: list[list[Group]] = [[]]
    args = 0
    for unit in order:
        group = by_name.get(unit)
        own = arguments(graph, group) if group is not None and _stage(graph, group) else None
        if own is None or args + own + 1 > MAX_ARGS:
            runs.append([])
            args = 0
        if own is not None:
            runs[-1].append(group)
            args += own
    chains = [run for run in runs if len(run) > 1]
    if not chains:
        return graph, {"chained_kernels": 0}
    first = {run[0].name: run for run in chains}
    absorbed = {g.name for run in chains for g in run[1:]}
    groups = [_chained(first[g.name]) if g.name in first else g for g in graph.groups]
    counters = [Node(sync_name(run[0].name), "constant", (2,), torch.int32) for run in chains]
    out = graph.replace_nodes(counters + list(graph.nodes.values()))
    out.constants |= {c.name: torch.zeros(2, dtype=torch.int32) for c in counters}
    out.groups = [g for g in groups if g.name not in absorbed]
    return out, {"chains": len(chains), "chained_kernels": sum(len(run) for run in chains)}


def _stage(graph: Graph, group: Group) -> bool:
    """Whether ``group``'s kernel can be a chain's stage: one a combination
    could hold, or a combination."""
    return not group.stages and all(combinable(graph, p) for p in group.parts or (group,))


def _chained(run: list[Group]) -> Group:
    """One group of ``run``'s kernels as stages: ``parts`` holds every
    stage's parts (a combination's own, or the stage itself), ``stages``
    how many parts each stage has."""
    parts = tuple(p for g in run for p in (g.parts or (g,)))
    return Group(
        run[0].name,
        tuple(dict.fromkeys(n for p in parts for n in p.nodes)),
        tuple(dict.fromkeys(n for p in parts for n in p.stored)),
        (),
        (),
        f"chained: {len(run)} dependent kernels ({', '.join(g.name for g in run)})",
        parts=parts,
        stages=tuple(len(g.parts) or 1 for g in run),
    )
