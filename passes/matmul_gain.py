"""What a matmul gains as a GEMM template, priced by the cost model.

``auto`` (``passes/matmul.py``) takes the template only where what fuses
into it saves more than the template loses to the library's faster tiles
(``compiler/cost.py``: the same model the static report prices with).  Three
things can fuse into a template and save memory traffic:

* a **prologue**: an operand that is a pointwise node this matmul alone
  reads, computed from narrower data (a dequantized weight).  With the
  library, a kernel writes the wide operand and the library reads it; the
  template reads the narrow data and computes the operand per tile.
* a **row norm**: the left operand computed, by nodes this matmul alone
  needs, from row reductions over K (an RMS norm): the library path runs
  the norm's kernel; the template computes the norm's statistic per tile
  (``codegen/gemm.py``), reading the rows again per column tile.
* an **epilogue**: the pointwise nodes of the product's shape (or a reshape
  of it) computed from the product and from values that do not depend on
  it: a bias, an activation, a residual.  The template stores them from the
  accumulator.  That saves the product's write and read only where an
  epilogue value is stored anyway: where fusion, with the product a library
  call, stores it (a library call, the graph output or kernels that cannot
  all compute it read it).  Where it is not (a softmax after
  ``q @ k.T / c``: the softmax kernel computes the scaled scores from the
  product itself), the template would write and the next kernel read as
  many bytes as the library and that kernel do, at the template's slower
  rate.

On a target without the model's figures (the Triton interpreter) times are
not predicted: a prologue takes the template (the wide operand is never
written), nothing else does (torch's CPU matmul is far faster than an
interpreted kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tilec import cost
from tilec import index as ix
from tilec.decisions import Reason
from tilec.gemm import (
    GEMM,
    computing,
    gemm_config,
    row_statistic_problem,
    template_config,
)
from tilec.ir import OUTPUT, Graph, Group, Node, base_inputs, is_free, view_base
from tilec.target import Target

Times = tuple[tuple[str, float], ...]


def fusion_gain(
    graph: Graph,
    node: Node,
    operands: tuple[str, str],
    read_by: dict,
    target: Target,
    stored: Callable[[], frozenset[str]],
) -> tuple[bool, Reason, tuple[tuple[str, float], ...]]:
    """(whether ``auto`` takes the template, why, the predicted seconds of
    each side) for matmul ``node`` with operands (left, right); ``stored()``:
    the nodes fusion stores with every matmul a library call."""
    prologue = _prologue(graph, node, operands, read_by)
    if not cost.has_figures(target):
        if prologue is not None:
            return True, Reason("prologue", f"auto: prologue %{prologue} from narrower data"), ()
        why = "auto: no prologue to fuse; under the interpreter only prologues pay"
        return False, Reason("interpreter_no_prologue", why), ()
    problem = _Problem(graph, node, operands)
    library = problem.library(target)
    template_bytes = problem.nbytes
    saved: list[str] = []
    if prologue is not None:
        # The template reads the narrow data; the library path also runs the
        # kernel that writes the wide operand.
        narrow = problem.bytes_of(base_inputs(graph, graph.nodes[prologue]))
        wide = problem.bytes_of([prologue])
        library += cost.kernel(target, narrow + wide).seconds
        template_bytes += narrow - wide
        saved.append(f"prologue %{prologue} from narrower data")
    norm = None if prologue is not None else _row_norm(graph, node, operands, read_by)
    reread = 0.0
    if norm is not None:
        # The library path runs the norm's kernel (its inputs read, the
        # normalized operand written); the template reads the inputs, and
        # every column tile reads the rows again (priced as memory traffic).
        inputs = problem.bytes_of(sorted(norm))
        wide = problem.bytes_of([view_base(graph, operands[0])])
        library += cost.kernel(target, inputs + wide).seconds
        template_bytes += inputs - wide
        reread = cost.memory_seconds(target, inputs * problem.column_tiles(target))
        saved.append(f"row norm of %{view_base(graph, operands[0])} in the prologue")
    kept = [name for name in _epilogue(graph, node, read_by) if name in stored()]
    if kept:
        # The template stores those instead of the product; the library path
        # writes the product, then a kernel reads it and writes them.
        kept_bytes = problem.bytes_of(kept)
        library += cost.kernel(target, problem.product_bytes + kept_bytes).seconds
        template_bytes += kept_bytes - problem.product_bytes
        saved.append("epilogue " + ", ".join(f"%{s}" for s in kept) + " stored anyway")
    template = problem.template(target, template_bytes) + reread
    times = (("library", library), ("template", template))
    if not saved:
        detail = "auto: nothing to fuse that would save memory traffic"
        return False, Reason("nothing_to_fuse", detail), times
    what = "; ".join(saved)
    if template < library:
        code = "prologue" if prologue is not None or norm is not None else "epilogue"
        return True, Reason(code, f"auto: {what}: the template is predicted faster"), times
    detail = f"auto: {what}, but the library is predicted faster"
    return False, Reason("library_faster", detail), times


def fused_gain(graph: Graph, group: Group, call: str, target: Target) -> tuple[bool, Times]:
    """Whether the template kernel ``group`` (fusion's, for the matmul whose
    call node was ``call``) is predicted faster than what the library path
    runs instead, and both predicted times.  The kernel as fused: the
    buffers its members read from outside it, the nodes it stores, over the
    tiles it launches.  The library path: the call (operands and product),
    a kernel computing the prologue's operand from what the prologue reads,
    and one computing the epilogue from the product and what the epilogue
    reads, storing what the template's kernel stores."""
    members = set(group.nodes)
    dot = next(graph.nodes[n] for n in group.nodes if GEMM.owns(graph.nodes[n]))
    operands = set(dot.inputs)
    prologue = {p for o in operands for p in computing(graph, o, members)}
    epilogue = members - prologue - {dot.name, call}
    work = GEMM.work(graph, dot)
    hint = lambda s: int(ix.hint(s, graph.hints))  # noqa: E731
    nbytes = lambda names: sum(hint(graph.nodes[n].nbytes) for n in names)  # noqa: E731
    stored = nbytes(group.stored)
    # The tiles and the dot's operand dtype as codegen takes them.
    m, n, k, dtype = GEMM.problem(graph, dot)
    chosen = template_config(graph, group, dot, target)
    batch = math.prod(hint(s) for s in dot.shape[:-2])
    tiles = cost.output_tiles(m, n, (chosen.config.block_m, chosen.config.block_n), batch)
    template = cost.gemm(
        target,
        work.flops,
        nbytes(_reads(graph, members)) + stored,
        dtype,
        template=True,
        tiles=tiles,
        k_loop=chosen.loop,
    ).seconds
    library = cost.gemm(target, work.flops, work.nbytes, work.dtype, template=False).seconds
    if prologue:
        wide = nbytes({view_base(graph, o) for o in operands} & prologue)
        library += cost.kernel(target, nbytes(_reads(graph, prologue)) + wide).seconds
    if epilogue:
        product = hint(ix.numel(dot.shape)) * work.dtype.itemsize
        reads = _reads(graph, epilogue) - {dot.name, call}
        library += cost.kernel(target, product + nbytes(reads) + stored).seconds
    return template < library, (("library", library), ("template", template))


def reduction_seconds(graph: Graph, group: Group, flops: float, target: Target) -> float:
    """The predicted seconds of ``group``, fusion's kernel of a matmul of
    ``flops`` written as a sum reduction (the option ``gemv_reduction``): a
    reduction kernel moving the buffers its members read from outside it
    and the nodes it stores, the FLOPs at the fp32 rate (as ``static``
    prices the kernel codegen writes)."""
    members = set(group.nodes)
    hint = lambda s: int(ix.hint(s, graph.hints))  # noqa: E731
    nbytes = sum(hint(graph.nodes[n].nbytes) for n in _reads(graph, members) | set(group.stored))
    return cost.kernel(target, nbytes, flops).seconds


def _reads(graph: Graph, names: set[str]) -> set[str]:
    """The buffers nodes ``names`` read from outside themselves."""
    return {b for m in names for b in base_inputs(graph, graph.nodes[m]) if b not in names}


class _Problem:
    """A matmul's sizes (at the graph's hints) and bytes, for the cost model."""

    def __init__(self, graph: Graph, node: Node, operands: tuple[str, str]):
        self.graph = graph
        hint = lambda s: int(ix.hint(s, graph.hints))  # noqa: E731
        *batch, self.m, self.n = (hint(s) for s in node.shape)
        self.batch = math.prod(batch)
        self.k = hint(graph.nodes[operands[0]].shape[-1])
        self.dtype = node.dtype
        self.flops = 2 * self.batch * self.m * self.n * self.k
        self.product_bytes = self.batch * self.m * self.n * node.dtype.itemsize
        operand_bytes = self.bytes_of(list(dict.fromkeys(base_inputs(graph, node))))
        self.nbytes = operand_bytes + self.product_bytes

    def bytes_of(self, names: list[str]) -> int:
        return sum(int(ix.hint(self.graph.nodes[n].nbytes, self.graph.hints)) for n in names)

    def library(self, target: Target) -> float:
        return cost.gemm(target, self.flops, self.nbytes, self.dtype, template=False).seconds

    def column_tiles(self, target: Target) -> int:
        """Column tiles of the template's grid, per batch element."""
        config = gemm_config(target, self.m, self.n, self.k, self.dtype)
        return math.ceil(self.n / config.block_n)

    def template(self, target: Target, nbytes: int) -> float:
        """The template moving ``nbytes``, over the tiles codegen launches."""
        config = gemm_config(target, self.m, self.n, self.k, self.dtype)
        tiles = cost.output_tiles(self.m, self.n, (config.block_m, config.block_n), self.batch)
        k_loop = config.k_loop(self.k, self.dtype.itemsize, target)
        return cost.gemm(
            target, self.flops, nbytes, self.dtype, template=True, tiles=tiles, k_loop=k_loop
        ).seconds


def _prologue(graph: Graph, node: Node, operands: tuple[str, str], read_by: dict) -> str | None:
    """The operand a prologue would compute (a pointwise node this matmul
    alone reads, computed from narrower data), or None."""
    for operand in operands:
        base = view_base(graph, operand)
        producer = graph.nodes[base]
        if producer.kind != "pointwise" or is_free(producer):
            continue
        if set(read_by[base]) != {node.name}:
            continue
        narrowest = min(graph.nodes[b].dtype.itemsize for b in base_inputs(graph, producer))
        if narrowest < producer.dtype.itemsize:
            return base
    return None


def _row_norm(
    graph: Graph, node: Node, operands: tuple[str, str], read_by: dict
) -> set[str] | None:
    """The buffers a row norm of the left operand reads, or None: the
    operand is computed, by nodes only this matmul needs, from row
    reductions over K (a sum, max or min of pointwise producers: an RMS
    norm's mean square) that a template's prologue computes
    (``GemmAnchor.row_reductions``)."""
    base = view_base(graph, operands[0])
    if graph.nodes[base].kind != "pointwise" or base == view_base(graph, operands[1]):
        return None
    if set(read_by[base]) != {node.name}:
        return None
    chain = {base}
    for n in reversed(list(graph.nodes.values())):  # readers before producers
        if n.name in chain or n.kind not in ("pointwise", "reduction") or is_free(n):
            continue
        if read_by[n.name] and set(read_by[n.name]) <= chain:
            chain.add(n.name)
    reductions = [graph.nodes[n] for n in chain if graph.nodes[n].kind == "reduction"]
    k = graph.nodes[operands[0]].shape[-1]
    if not reductions or any(row_statistic_problem(graph, r, chain, k) for r in reductions):
        return None
    return {b for n in chain for b in base_inputs(graph, graph.nodes[n]) if b not in chain}


def _epilogue(graph: Graph, node: Node, read_by: dict) -> list[str]:
    """The nodes a template's epilogue could compute, in graph order: the
    closure of pointwise nodes of the product's size computed from the
    product, the epilogue, and values that do not depend on the product (a
    node reading a reduction of the product, the normalisation of a
    softmax, needs whole rows: not an epilogue)."""
    if not read_by[node.name] or OUTPUT in read_by[node.name]:
        return []  # a graph output: the product is stored anyway
    downstream = _downstream(graph, node.name)
    epilogue = {node.name}
    for candidate in graph.nodes.values():
        if candidate.name not in downstream or candidate.kind != "pointwise":
            continue
        # As fusion's GEMM kernels allow: values of the product's size, read
        # at the product's positions through any view (a permute back to NCHW).
        if ix.numel(candidate.shape) != ix.numel(node.shape):
            continue
        sources = {view_base(graph, i) for i in candidate.inputs}
        if sources & epilogue and all(s in epilogue or s not in downstream for s in sources):
            epilogue.add(candidate.name)
    epilogue.discard(node.name)
    return [name for name in graph.nodes if name in epilogue]


def _downstream(graph: Graph, name: str) -> set[str]:
    """Every node computed, directly or not, from node ``name``."""
    found = {name}
    for node in graph.nodes.values():  # topological order
        if any(i in found for i in node.inputs):
            found.add(node.name)
    return found
