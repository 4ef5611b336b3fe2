"""Fusion: group pointwise and reduction nodes into kernels.

Every pointwise/reduction node starts as its own group.  Candidate merges are
producer -> consumer edges and siblings that read the same buffer, scored by
the time the cost model predicts the merge saves (the bytes of memory
traffic it saves and one launch; the bytes alone under the interpreter,
which has no figures, an equal ranking); they are tried greedily, best
first, and each merge's decision records that time.  A merge is legal when

* it creates no cycle (no path between the two groups through a third one,
  such as a matmul that reads one group and feeds the other),
* the iteration spaces agree: all reductions run over the same rows x
  reduction extent, and every node the group must store is shaped like a row
  (``shape``) or a full row x reduction tile (``shape + reduce_shape``), or
  for pointwise groups like the one common shape,
* every read of the group's own reductions is at the current row (a
  reduction result is only known for the rows the kernel computes).

A scatter (an indexed store) runs over its values' iteration space: its
group may compute the values (and store other nodes of that shape, or hold
other scatters over updates of that shape), but not the scatter's base, nor
anything that reads the scatter (its buffer is only complete when the
kernel ends).  Each scatter gets a second group before its
own, ``init``, that writes the base into the scatter's buffer: it copies
the base, or computes it when the base's own kernel would store nothing but
the base for the scatter alone (that kernel is then not emitted).

Views never become kernels: readers fold them into their loads.  Nor do
pointwise nodes that read no tensor (constants, iotas) when only kernels read
them: each reader recomputes them.  Each
decision, accepted or rejected, is recorded in ``Graph.decisions`` (stage
``fuse``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import networkx as nx

from tilec import cost
from tilec import index as ix
from tilec.anchors import anchor_of, anchors_in
from tilec.decisions import Decision, Reason
from tilec.gemm import row_statistic_problem
from tilec.inline import (
    Inliner,
    is_row_shape,
    kernel_loads,
    row_loads,
    row_statistics,
    tile_indices,
)
from tilec.ir import (
    KERNEL_KINDS,
    OUTPUT,
    Graph,
    Group,
    Load,
    Node,
    buffers_of,
    is_free,
    readers,
    reads_own_position,
    view_base,
    walk,
)
from tilec.target import INTERPRETER, Target

COMPUTE = KERNEL_KINDS


def fuse(
    graph: Graph, enabled: bool = True, target: Target = INTERPRETER
) -> tuple[Graph, dict[str, int]]:
    """Partition the compute nodes into kernels (one per node when disabled)
    for ``target``: what a template kernel may hold is priced on it
    (``compiler/anchors.py``)."""
    state = _FusionState(graph, target)
    if enabled:
        state.merge_greedily()
    ordered = state.ordered_groups()
    # Each scatter's init kernel, and the kernel whose work it takes over.
    inits = {
        name: state.base_kernel(name) if enabled else []
        for members in ordered
        for name in members
        if graph.nodes[name].kind == "scatter"
    }
    taken = {m for members in inits.values() for m in members}
    groups: list[Group] = []
    for members in ordered:
        if members[0] in taken:
            continue
        for name in members:
            if name in inits:
                groups.append(_init_group(graph, f"k{len(groups)}", name, inits[name]))
        groups.append(state.build_group(len(groups), members))
    out = graph.replace_nodes(list(graph.nodes.values()))
    out.groups = groups
    out.decisions = graph.decisions + state.log
    merged = sum(len(g.nodes) - 1 for g in groups if not g.init)
    return out, {"kernels": len(groups), "nodes_fused": merged, "rejected": state.rejected}


class _FusionState:
    def __init__(self, graph: Graph, target: Target):
        self.graph, self.target = graph, target
        self.order = {name: k for k, name in enumerate(graph.nodes)}
        # Readers of every buffer a kernel may store (OUTPUT: a graph output),
        # through views and through recomputed nodes.
        read_by = readers(graph)
        self.inlined = graph.recomputed()
        self.consumers = {
            n: set(read_by[n])
            for n, node in graph.nodes.items()
            if node.kind != "view" and n not in self.inlined
        }
        self.group_of: dict[str, str] = {}
        self.members: dict[str, list[str]] = {}
        for node in graph.nodes.values():
            if node.kind in COMPUTE and node.name not in self.inlined:
                self.group_of[node.name] = node.name
                self.members[node.name] = [node.name]
        self.log: list[Decision] = [
            Decision.of("fuse", f"%{name}", "inlined", _why_inlined(graph.nodes[name]))
            for name in sorted(self.inlined)
        ]
        self.why: dict[str, list[str]] = {}  # group -> kinds of the merges that built it
        self.rejected = 0
        self._tried: set[tuple[frozenset, frozenset]] = set()
        self._units: nx.DiGraph | None = None  # unit_graph(), kept up to date by merges
        self._reads: dict[str, tuple[int, Counter[str]]] = {}  # body_reads() per node

    # ------------------------------------------------------------ structure
    def unit(self, name: str) -> str:
        return self.group_of.get(name, name)

    def unit_graph(self) -> nx.DiGraph:
        """Groups (and extern nodes) and which reads which: built once, then
        contracted by each merge (``merge_round``), not rebuilt per check."""
        if self._units is None:
            self._units = self._build_unit_graph()
        return self._units

    def _build_unit_graph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for name, users in self.consumers.items():
            g.add_node(self.unit(name))
            for u in users:
                if u != OUTPUT and self.unit(u) != self.unit(name):
                    g.add_edge(self.unit(name), self.unit(u))
        return g

    def is_stored(self, name: str, members: set[str]) -> bool:
        return any(u not in members for u in self.consumers[name])

    def ordered_groups(self) -> list[list[str]]:
        units = self.unit_graph()
        first = {gid: min(self.order[n] for n in m) for gid, m in self.members.items()}
        key = {u: first.get(u, self.order.get(u, -1)) for u in units}
        order = nx.lexicographical_topological_sort(units, key=lambda u: key[u])
        return [sorted(self.members[u], key=self.order.get) for u in order if u in self.members]

    # -------------------------------------------------------------- merging
    def candidates(self) -> list[tuple[int, str, str, str]]:
        """(bytes saved, group a, group b, kind) for producer->consumer and siblings."""
        cands: dict[tuple[str, str], tuple[int, str]] = {}
        for name, users in self.consumers.items():
            if name in self.inlined:
                continue
            # Symbolic sizes are scored at the sizes the graph is compiled for.
            nbytes = ix.hint(self.graph.nodes[name].nbytes, self.graph.hints)
            groups_reading = {self.unit(u) for u in users if u in self.group_of}
            if name in self.group_of:
                a = self.unit(name)
                for b in groups_reading - {a}:
                    inner = all(u != OUTPUT and self.unit(u) in (a, b) for u in users)
                    saved = nbytes * (2 if inner else 1)
                    prev = cands.get((a, b), (0, "producer->consumer"))[0]
                    cands[(a, b)] = (prev + saved, "producer->consumer")
            for a, b in itertools.combinations(sorted(groups_reading), 2):
                if (a, b) not in cands and (b, a) not in cands:
                    cands[(a, b)] = (nbytes, "siblings share a read")
                elif (a, b) in cands and cands[(a, b)][1] == "siblings share a read":
                    cands[(a, b)] = (cands[(a, b)][0] + nbytes, "siblings share a read")
        out = [(saved, a, b, kind) for (a, b), (saved, kind) in cands.items()]
        return sorted(out, key=lambda c: (-self.benefit(c[0]), self.order[c[1]], self.order[c[2]]))

    def benefit(self, nbytes: int) -> float:
        """A merge's score: the seconds the cost model predicts it saves on
        the target (the ``nbytes`` of traffic and one launch), or, without
        figures (the interpreter), the bytes.  Every merge saves one launch,
        so both rank candidates alike."""
        if not cost.has_figures(self.target):
            return float(nbytes)
        return cost.memory_seconds(self.target, nbytes) + cost.launch_seconds(self.target)

    def saves(self, nbytes: int) -> tuple[tuple[str, float], ...]:
        """The predicted time a merge saving ``nbytes`` saves, for its decision
        (none without figures)."""
        return (("saved", self.benefit(nbytes)),) if cost.has_figures(self.target) else ()

    def merge_greedily(self) -> None:
        # GEMM epilogues first: a residual add that a layer norm reads then
        # goes into the GEMM (its output written once), not into the norm's
        # kernel (the GEMM's output written and read back); only nodes that
        # are stored anyway (``stored_anyway``) go first.  Prologues last:
        # a node computed once in an epilogue (or a kernel of its own) beats
        # one recomputed for every tile of a GEMM.
        for phase in ("epilogues", "others", "prologues"):
            self.merge_round(phase)

    def merge_round(self, phase: str) -> None:
        while True:
            changed: set[str] = set()
            for saved, a, b, kind in self.candidates():
                if a in changed or b in changed:
                    continue
                merge = kind == "producer->consumer"
                if phase == "epilogues" and not (
                    merge and self.into_epilogue(a, b) and self.stored_anyway(b, a)
                ):
                    continue
                if phase != "prologues" and self.into_prologue(a, b):
                    continue
                key = (frozenset(self.members[a]), frozenset(self.members[b]))
                if key in self._tried:
                    continue
                self._tried.add(key)
                reason = self.illegal(a, b)
                names = " + ".join(
                    "{" + ", ".join(f"%{m}" for m in self.members[g]) + "}" for g in (a, b)
                )
                if reason:
                    self.rejected += 1
                    self.log.append(Decision.of("fuse", names, "rejected", reason))
                    continue
                why = Reason(MERGE_CODES[kind], kind)
                self.log.append(
                    Decision.of(
                        "fuse",
                        names,
                        "fused",
                        why,
                        bytes_saved=saved,
                        predicted_s=self.saves(saved),
                    )
                )
                self.why[a] = self.why.get(a, []) + self.why.pop(b, []) + [kind]
                self.members[a] += self.members.pop(b)
                for n in self.members[a]:
                    self.group_of[n] = a
                nx.contracted_nodes(self.unit_graph(), a, b, self_loops=False, copy=False)
                changed |= {a, b}
            if not changed:
                return

    def anchored(self, unit: str) -> bool:
        """Whether the group is a template kernel's: it holds an anchor."""
        return bool(anchors_in(self.graph, self.members[unit]))

    def into_prologue(self, a: str, b: str) -> bool:
        """Whether merging groups ``a`` and ``b`` (as producer and consumer, or
        as siblings) puts what one computes into the other's template
        prologue: it holds an operand the other's anchor reads per tile."""
        for templated, other in ((a, b), (b, a)):
            found = anchors_in(self.graph, self.members[templated])
            if found and not self.anchored(other):
                anchor, node = found[0]
                if set(anchor.operands(self.graph, node)) & set(self.members[other]):
                    return True
        return False

    def stored_anyway(self, group: str, gemm: str) -> bool:
        """Whether ``group`` joining template kernel ``gemm``'s epilogue stores nothing that
        would not be stored anyway: none of its nodes is read, outside both,
        by one reduction kernel alone.  Such a node (a residual's square,
        read by the norm's mean) is better computed in that kernel, where it
        need not be stored at all."""
        inside = {self.unit(m) for m in (*self.members[group], *self.members[gemm])}
        for name in self.members[group]:
            outside = {OUTPUT if u == OUTPUT else self.unit(u) for u in self.consumers[name]}
            outside -= inside
            if len(outside) == 1 and OUTPUT not in outside:
                (unit,) = outside
                if any(self.graph.nodes[m].kind == "reduction" for m in self.members.get(unit, [])):
                    return False
        return True

    def into_epilogue(self, producer: str, consumer: str) -> bool:
        """Whether merging makes ``consumer`` part of a template kernel's epilogue."""
        return self.anchored(producer) and not self.anchored(consumer)

    def illegal(self, a: str, b: str) -> Reason | None:
        units = self.unit_graph()
        for src, dst in ((a, b), (b, a)):
            for mid in units.successors(src):
                if mid not in (a, b) and nx.has_path(units, mid, dst):
                    return Reason("cycle", f"would create a cycle through %{mid}")
        members = set(self.members[a]) | set(self.members[b])
        size = inlined_size(
            self.graph,
            sorted(members, key=self.order.get),
            lambda m: self.is_stored(m, members),
            self._reads,
        )
        if size > MAX_INLINED:
            return Reason(
                "too_much_recomputed",
                f"its pointwise nodes inlined where they are read would make {size} "
                f"operations (at most {MAX_INLINED})",
            )
        space = self.space(members)
        if isinstance(space, Reason):
            return space
        return self.row_reads_problem(members, *space)

    def space(self, members: set[str]) -> tuple[tuple[int, ...], tuple[int, ...]] | Reason:
        nodes = [self.graph.nodes[m] for m in members]
        scatters = [n for n in nodes if n.kind == "scatter"]
        if scatters:
            return self.scatter_space(members, nodes, scatters)
        anchored = [(anchor_of(n), n) for n in nodes if anchor_of(n) is not None]
        if len({anchor.kind for anchor, _ in anchored}) > 1:
            return Reason("two_templates", "anchors of two template kinds in one kernel")
        if anchored:
            anchor, node = anchored[0]
            return anchor.space(
                self.graph, node, nodes, lambda n: self.is_stored(n, members), self.target
            )
        reds = {(n.shape, n.reduce_shape) for n in nodes if n.kind == "reduction"}
        if len(reds) > 1:
            space = self.statistics_space(members, reds)
            if isinstance(space, Reason):
                return space
            reds = {space}
        stored = [n for n in nodes if n.kind == "pointwise" and self.is_stored(n.name, members)]
        if reds:
            ((rows, rshape),) = reds
            tiles = tile_indices(self.graph, members, rows, rshape)
            for n in stored:
                if n.shape not in tiles and not is_row_shape(n.shape, rows):
                    return Reason(
                        "neither_row_nor_tile",
                        f"%{n.name} {list(n.shape)} is neither a row {list(rows)} nor a full "
                        f"tile {list(rows + rshape)} (or an order of it the reductions read)",
                    )
            return rows, rshape
        shapes = {n.shape for n in stored}
        if len(shapes) > 1:
            ordered = sorted((list(s) for s in shapes), key=str)
            return Reason("stored_shapes", f"stored values have different shapes {ordered}")
        return (shapes.pop() if shapes else nodes[0].shape), ()

    def statistics_space(
        self, members: set[str], reds: set[tuple[tuple, tuple]]
    ) -> tuple[tuple, tuple] | Reason:
        """The space of a reduction kernel whose reductions run over different
        rows: those over the most rows, where every other reduction is a row
        statistic of them (``inline.row_statistics``: an RMS norm's mean
        square, read by a decode GEMV's sum at one position per row), over the
        same elements, stored nowhere, computed from pointwise producers
        (``gemm.row_statistic_problem``) and from nothing the kernel does not
        load anyway, so that the kernel computes it again for each of its
        rows at no cost in memory traffic."""
        spaces = " vs ".join(map(str, sorted(reds, key=str)))
        differ = Reason("reduction_spaces", f"reductions over different iteration spaces {spaces}")
        if len({rshape for _, rshape in reds}) > 1 or len(next(iter(reds))[1]) != 1:
            return differ
        sizes = {rows: ix.hint(ix.numel(rows), self.graph.hints) for rows, _ in reds}
        most = max(sizes.values())
        if sum(size == most for size in sizes.values()) > 1:
            return differ
        rows, rshape = next((rows, rshape) for rows, rshape in reds if sizes[rows] == most)
        ordered = sorted(members, key=self.order.get)
        stored = [m for m in ordered if self.is_stored(m, members)]
        loads = row_loads(self.graph, ordered, stored, rows, rshape)
        statistics = row_statistics(self.graph, ordered, rows, loads)
        made = {(load.buffer, load.index) for load in loads}
        for name in ordered:
            node = self.graph.nodes[name]
            if node.kind != "reduction" or node.shape == rows:
                continue
            where = f"reduction %{name} {list(node.shape)} in a kernel over rows {list(rows)}"
            why = row_statistic_problem(self.graph, node, members, rshape[0])
            if why is None and name in stored:
                why = "is read outside it"
            if why is None and name not in statistics:
                why = "is read at more than one position per row, or not at one of the row's"
            if why is None:
                inliner = Inliner(self.graph, members, ix.symbol_ranges(rows, rshape))
                own = inliner.loads(inliner.body(node, statistics[name]))
                extra = sorted(
                    {load.buffer for load in own if (load.buffer, load.index) not in made}
                )
                if extra:
                    why = f"reads {', '.join(f'%{b}' for b in extra)} where the kernel does not"
            if why is not None:
                return Reason("row_statistic", f"{where} {why}")
        return rows, rshape

    def scatter_space(
        self, members: set[str], nodes: list[Node], scatters: list[Node]
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | Reason:
        """A scatter's group runs over its updates; see the module docstring.
        Scatters whose updates have one shape (a step's key and value cache
        writes) share the kernel."""
        updates = {tuple(n.update_shape) for n in scatters}
        if len(updates) > 1:
            # Sorted as text: sizes may be symbolic (no order between them).
            shapes = sorted(updates, key=str)
            return Reason("scatter_shapes", f"scatters over different updates {shapes}")
        if any(n.kind == "reduction" for n in nodes):
            return Reason(
                "scatter_and_reduction",
                f"scatter %{scatters[0].name} and a reduction in one kernel",
            )
        (update_shape,) = updates
        for node in scatters:
            inside = sorted(set(self.consumers[node.name]) & members)
            if inside:
                return Reason(
                    "reads_scatter",
                    f"%{inside[0]} reads scatter %{node.name}, complete only after its kernel",
                )
            for base in buffers_of(self.graph, node.inputs[0]):
                if base in members:
                    return Reason(
                        "scatter_base",
                        f"%{base} is the base of scatter %{node.name}, copied before its kernel",
                    )
        for n in nodes:
            if n.kind != "scatter" and self.is_stored(n.name, members) and n.shape != update_shape:
                return Reason(
                    "not_over_updates",
                    f"%{n.name} {list(n.shape)} is not stored over the updates "
                    f"{list(update_shape)} of scatter %{scatters[0].name}",
                )
        return update_shape, ()

    def base_kernel(self, scatter: str) -> list[str]:
        """The members of the kernel that computes scatter ``scatter``'s base
        when its init kernel can compute the base instead (saving the base's
        write and read): a pointwise kernel that stores only the base, which
        only the scatter reads.  Empty otherwise."""
        base = view_base(self.graph, self.graph.nodes[scatter].inputs[0])
        if base not in self.group_of or set(self.consumers[base]) != {scatter}:
            return []
        members = self.members[self.group_of[base]]
        pointwise = all(self.graph.nodes[m].kind == "pointwise" for m in members)
        if not pointwise or [m for m in members if self.is_stored(m, set(members))] != [base]:
            return []
        why = Reason("base_read_by_scatter_only", f"its init kernel computes its base %{base}")
        self.log.append(Decision.of("fuse", f"%{scatter}", "init computes base", why))
        return members

    def row_reads_problem(self, members: set[str], rows: tuple, rshape: tuple) -> Reason | None:
        """Reads of the group's own reductions must be at the current row (a
        GEMM's prologue reductions: its anchor checks them)."""
        reds = {m for m in members if self.graph.nodes[m].kind == "reduction"}
        anchors = {m for m in reds if anchor_of(self.graph.nodes[m]) is not None}
        # Row statistics are computed where they are read (``statistics_space``).
        reds = anchors or {m for m in reds if self.graph.nodes[m].shape == rows}
        if not reds:
            return None
        members_in_order = sorted(members, key=self.order.get)
        stored = [m for m in members_in_order if self.is_stored(m, members)]
        for load in kernel_loads(self.graph, members_in_order, stored, rows, rshape):
            if load.buffer in reds and not reads_own_position(load, rows):
                return Reason(
                    "reduction_off_row",
                    f"reads reduction %{load.buffer} at {list(load.index)}, not at the current row",
                )
        return None

    def build_group(self, k: int, members: list[str]) -> Group:
        member_set = set(members)
        space = self.space(member_set)
        assert not isinstance(space, Reason), space
        stored = tuple(m for m in members if self.is_stored(m, member_set))
        kinds = Counter(self.why.get(self.group_of[members[0]], []))
        reason = (
            "single node"
            if len(members) == 1
            else "fused " + ", ".join(f"{n} x {kind}" for kind, n in sorted(kinds.items()))
        )
        return Group(f"k{k}", tuple(members), stored, space[0], space[1], reason)


MERGE_CODES = {"producer->consumer": "producer_consumer", "siblings share a read": "siblings"}

# The most operations a kernel's expression may have once its pointwise
# nodes are inlined where they are read (:func:`inlined_size`).  A node
# read at k positions is computed k times (a 3 x 3 pooling window over a
# ReLU computes it 9 times); a chain of nodes each reading the one before
# twice (``m[i] += 1`` repeated: the value at a slice and the value beside
# it) doubles the work at every link, which took compiles past minutes.
MAX_INLINED = 20_000


def inlined_size(
    graph: Graph,
    members: list[str],
    stored: Callable[[str], bool],
    reads: dict[str, tuple[int, Counter[str]]] | None = None,
) -> int:
    """The operations of a kernel over ``members`` (in the graph's order)
    once every pointwise member is inlined into its readers (``stored``: whether a member is
    written out, computed once for that): each member's body size times
    the times it is computed, the sum of its readers' times over each of
    their loads of it.  Reductions and scatters are computed once; their
    results are loaded, not inlined.  ``reads``: :func:`body_reads` of
    nodes, filled as they are met."""
    reads = {} if reads is None else reads
    times: Counter[str] = Counter()
    inside = set(members)
    total = 0
    for name in reversed(members):
        if name not in reads:
            reads[name] = body_reads(graph, graph.nodes[name])
        size, loads = reads[name]
        if graph.nodes[name].kind != "pointwise" or stored(name):
            times[name] += 1
        total += times[name] * size
        for source, count in loads.items():
            if source in inside and graph.nodes[source].kind == "pointwise":
                times[source] += count * times[name]
    return total


def body_reads(graph: Graph, node: Node) -> tuple[int, Counter[str]]:
    """``node``'s body size (expressions) and its loads per node read
    (views followed to the node under them)."""
    size, loads = 0, Counter()
    for expr in walk(node.body) if node.body is not None else ():
        size += 1
        if isinstance(expr, Load):
            loads[view_base(graph, node.inputs[expr.src])] += 1
    return size, loads


def _why_inlined(node: Node) -> Reason:
    if is_free(node):
        return Reason("reads_no_tensor", "into every reader: reads no tensor")
    return Reason("widening_cast", "into every reader: a widening cast or copy")


def _init_group(graph: Graph, name: str, scatter: str, members: list[str]) -> Group:
    """The kernel that writes scatter ``scatter``'s base into its buffer:
    computes it from ``members`` (the base's own kernel), or copies it."""
    node = graph.nodes[scatter]
    how = "computes" if members else "copies"
    reason = f"initial value of scatter %{scatter}: {how} its base %{node.inputs[0]}"
    return Group(name, tuple(members), (scatter,), node.shape, (), reason, init=True)
