"""The decomposition table AOTAutograd applies before lowering.

Core ATen decompositions, plus composite ops that tilec prefers to see as
their parts, so that fusion can put them back together as one kernel:
norms and softmax become reductions and pointwise ops, activations become
pointwise math.  Ops tilec lowers natively (embedding, index_select, repeat,
...) are left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten

EXTRA = [
    aten.native_layer_norm,
    aten.native_group_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit_no_training,
    # no_training decomposes into this one; with training=False it mutates nothing.
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._softmax,
    aten._log_softmax,
    aten.gelu,
    aten.silu,
    aten.hardtanh,
    aten.leaky_relu,
    aten.elu,
    aten.celu,
    aten.selu,
    aten.hardswish,
    aten.hardsigmoid,
    aten.mish,
    aten.softplus,
    aten.threshold,
    aten.glu,
    aten.logit,
    aten.std_mean,
    aten.addcmul,
    aten.addcdiv,
    aten.lerp,
    aten.rsub,
    aten.nan_to_num,
    aten.hardshrink,
    aten.softshrink,
    aten.xlogy,
    aten.logaddexp,
    aten.linalg_vector_norm,
]

# Lowered natively: keep them whole even where the core table splits them.
KEEP = [aten.embedding, aten.index_select, aten.repeat]

# Library calls: the core table's version of CPU flash attention returns the
# attention probabilities where the op returns the logsumexp, so its backward
# (an ATen call) gets wrong gradients, and its output has other strides.
LIBRARY = [aten._scaled_dot_product_flash_attention_for_cpu]


# ``torch._foreach_<op>`` (what optimizers trace to with ``foreach=True``,
# their default on CUDA, and what ``clip_grad_norm_`` calls): the op on each
# tensor of the list, by the per-tensor function here.  Fusion and
# ``passes/combine.py`` put the per-tensor kernels back into few launches.
FOREACH: dict[str, Callable] = {
    **{
        name: getattr(torch, name)
        for name in (
            "add",
            "sub",
            "mul",
            "div",
            "addcmul",
            "addcdiv",
            "lerp",
            "pow",
            "sqrt",
            "rsqrt",
            "neg",
            "reciprocal",
            "abs",
            "exp",
            "sign",
            "maximum",
            "minimum",
            "clamp_min",
            "clamp_max",
            "sigmoid",
            "log",
            "zeros_like",
        )
    },  # fmt: skip
    "zero": torch.zeros_like,
    "norm": lambda t, ord=2, dtype=None: torch.linalg.vector_norm(t, ord, dtype=dtype),
}
# Arguments the per-tensor functions take by keyword only.
_KEYWORDS = {"value", "alpha", "dtype"}


def foreach_decompositions() -> dict:
    """Each functional overload of the ``FOREACH`` ops, as a list of
    per-tensor calls: list arguments (``Tensor[]``, ``Scalar[]``) taken
    element by element, the others (a scalar, a tensor such as the clipping
    coefficient) passed to every call.  Overloads with a tensor of
    per-element scalars (``addcmul.Tensor``) stay whole."""
    table: dict = {}
    for name, fn in FOREACH.items():
        packet = getattr(aten, f"_foreach_{name}", None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            schema = op._schema
            if overload.endswith("out") or any(
                a.name == "scalars" and str(a.type) == "Tensor" for a in schema.arguments
            ):
                continue
            table[op] = functools.partial(_per_tensor, fn, schema)
    return table


def _per_tensor(fn: Callable, schema: Any, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    values = [
        args[k] if k < len(args) else kwargs.get(a.name, a.default_value)
        for k, a in enumerate(schema.arguments)
    ]
    lists = {k for k, a in enumerate(schema.arguments) if isinstance(a.type, torch.ListType)}
    (count,) = {len(values[k]) for k in lists}
    calls = []
    for i in range(count):
        positional, keywords = [], {}
        for k, a in enumerate(schema.arguments):
            v = values[k][i] if k in lists else values[k]
            if a.name in _KEYWORDS:
                keywords[a.name] = v
            else:
                positional.append(v)
        calls.append(fn(*positional, **keywords))
    return calls


def decomposition_table() -> dict:
    """The decompositions tilec traces with (AOTAutograd's table): a copy of
    one built once per process (building it takes about 25 ms, once per
    graph compiled otherwise)."""
    return dict(_decomposition_table())


@functools.cache
def _decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(EXTRA))
    table.update(foreach_decompositions())
    for op in KEEP + LIBRARY:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    table[aten.cumsum.default] = _cumsum
    pool = aten._adaptive_avg_pool2d.default
    table[pool] = functools.partial(_adaptive_avg_pool2d, get_decompositions([pool])[pool])
    table[aten._adaptive_avg_pool2d_backward.default] = _adaptive_avg_pool2d_backward
    table[aten.histc.default] = _histc
    table[aten._weight_norm_interface_backward.default] = _weight_norm_backward
    # Where the core table's version disagrees with eager, tilec's own.
    masked_index = aten._unsafe_masked_index.default
    table[masked_index] = functools.partial(_wrapped_masked_index, table[masked_index])
    return table


# The longest dimension a prefix sum is written as a reduction along: each
# output element sums up to this many terms.  A longer one stays torch's
# (an ATen fallback, counted and in the dump).
CUMSUM_MAX = 1024


def _cumsum(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``cumsum`` along a dimension of size ``n <= CUMSUM_MAX`` (for a
    symbolic size, a guard unless a bound is set on it) as one
    masked reduction, ``out[i] = sum(x[j] for j <= i)``: a kernel reads each
    row's ``n`` elements and sums ``n`` terms per output, instead of a scan
    falling back to ATen (MoE routing's offsets, position ids from a mask).
    The dtype is eager's: ``dtype``, else int64 for integer and bool inputs."""
    if dtype is None:
        dtype = x.dtype if x.is_floating_point() or x.is_complex() else torch.int64
    if x.dim() == 0:
        return x.to(dtype).clone()
    d = dim % x.dim()
    n = x.shape[d]
    bound = _upper_bound(n)
    if CUMSUM_MAX < bound < float("inf"):
        return NotImplemented  # too long, or a bound the user may have set: never narrowed
    # Of a symbolic length without an upper bound, the comparison is a guard:
    # a longer call compiles again, and falls back.
    if n > CUMSUM_MAX:
        return NotImplemented
    j = torch.arange(n, device=x.device)
    # keep[i, j, 1, ...]: whether x[j] is in out[i], over x's later dimensions.
    keep = (j.unsqueeze(1) >= j).view(n, n, *[1] * (x.dim() - d - 1))
    # sum's own dtype would be int64 for any integer: the sum in ``dtype``.
    return torch.where(keep, x.to(dtype).unsqueeze(d), 0).sum(d + 1, dtype=dtype)


def _upper_bound(n: int | torch.SymInt) -> float:
    """The largest value size ``n`` may take: itself, or a symbolic size's
    bound (infinite where nothing bounds it)."""
    if not isinstance(n, torch.SymInt):
        return n
    return float(n.node.shape_env.bound_sympy(n.node.expr).upper)


# The most elements an adaptive average pool's window may hold for the pool
# to be written as a sum of that many gathers (torch's decomposition unrolls
# the window); a larger one stays torch's (an ATen fallback, counted and in
# the dump).  Windows that tile the input evenly make an ``avg_pool2d``
# whatever their size.  Inductor draws the line at 25 too.
ADAPTIVE_WINDOW_MAX = 25


def _adaptive_window(size: int, out: int) -> int:
    """The longest window of an adaptive pool from ``size`` to ``out``
    positions: ``ceil((i + 1) * size / out) - floor(i * size / out)``."""
    return size // out if size % out == 0 else -(-size // out) + 1


def _adaptive_avg_pool2d(
    decomposition: Callable, x: torch.Tensor, output_size: list[int]
) -> torch.Tensor:
    """``_adaptive_avg_pool2d`` (AlexNet's and VGG's 6 x 6 or 7 x 7 pool;
    a 1 x 1 one is a mean before it gets here) as torch decomposes it: an
    ``avg_pool2d`` where the windows tile the input evenly, else a sum of
    shifted gathers where the windows are small (:data:`ADAPTIVE_WINDOW_MAX`)."""
    sizes = (*x.shape[-2:], *output_size)
    if not all(isinstance(s, int) for s in sizes):
        return NotImplemented
    h, w, oh, ow = sizes
    even = h % oh == 0 and w % ow == 0
    if not even and _adaptive_window(h, oh) * _adaptive_window(w, ow) > ADAPTIVE_WINDOW_MAX:
        return NotImplemented
    return decomposition(x, output_size)


def _adaptive_avg_pool2d_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of an adaptive average pool.  Where the windows tile the
    input evenly, ``avg_pool2d``'s (tilec's gathered gradient), with the
    pool's window as kernel and stride.  Elsewhere (torch has no
    decomposition of this backward) the pool is separable, ``out = P_h @ x
    @ P_w.T`` with ``P[o, i] = 1 / len(window o)`` where input position
    ``i`` is in window ``o``, so the gradient is ``P_h.T @ grad @ P_w``: two
    small matmuls, in float32 (float64 for float64), rounded to the
    gradient's dtype once."""
    sizes = (*x.shape[-2:], *grad.shape[-2:])
    if not all(isinstance(s, int) for s in sizes):
        return NotImplemented
    h, w, oh, ow = sizes
    if h % oh == 0 and w % ow == 0:
        kernel = [h // oh, w // ow]
        return aten.avg_pool2d_backward(grad, x, kernel, kernel, [0, 0], False, True, None)
    dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    rows, cols = _pooling(h, oh, dtype, grad.device), _pooling(w, ow, dtype, grad.device)
    out = (rows.t() @ grad.to(dtype) @ cols).to(grad.dtype)
    return out.contiguous(memory_format=torch._prims_common.suggest_memory_format(x))


def _pooling(n: int, windows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``windows x n`` matrix of an adaptive average pool along one
    dimension: window ``o`` spans ``floor(o * n / windows)`` up to
    ``ceil((o + 1) * n / windows)``, each of its positions weighted by one
    over its length."""
    o = torch.arange(windows, device=device)
    start, end = (o * n) // windows, ((o + 1) * n + windows - 1) // windows
    i = torch.arange(n, device=device)
    inside = (i >= start[:, None]) & (i < end[:, None])
    return inside.to(dtype) / (end - start)[:, None].to(dtype)


def _histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``histc`` over a given range (``min < max``; MoE routing's count of
    tokens per expert) as an accumulating scatter of ones: element ``v`` in
    ``[min, max]`` counts in bin ``floor((v - min) * bins / (max - min))``,
    ``max`` in the last one; NaN and elements outside count nowhere, as in
    eager.  Counts accumulate in float32.  Without a range (eager takes the
    data's, and raises where it is not finite) it stays torch's."""
    if not min < max:
        return NotImplemented
    inside = (x >= min) & (x <= max)
    position = ((x.float() - min) * bins / (max - min)).floor().clamp(0, bins - 1)
    position = torch.where(inside, position, 0)  # NaN has no bin; it counts 0 in bin 0
    counts = torch.zeros(bins, dtype=torch.float32, device=x.device)
    ones = inside.to(torch.float32).flatten()
    counts = torch.index_put(counts, [position.long().flatten()], ones, accumulate=True)
    return counts.to(x.dtype)


def _weight_norm_backward(
    grad_w: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    norms: torch.Tensor,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of weight normalization's ``w = v * g / norms`` (torch
    has no decomposition of its backward; wav2vec2's and HuBERT's
    positional convolution): with ``s`` the sum of ``grad_w * v`` over every
    dimension but ``dim`` (``norms``' own shape), ``grad_g = s / norms`` and
    ``grad_v = g / norms * (grad_w - v * s / norms**2)``.  In float32 for
    narrower inputs, as eager's kernels accumulate."""
    compute = torch.promote_types(v.dtype, torch.float32)
    grad_w, v32, g32, norms = (t.to(compute) for t in (grad_w, v, g, norms))
    others = [k for k in range(v.dim()) if k != dim % v.dim()]
    s = (grad_w * v32).sum(others, keepdim=True)
    grad_v = g32 / norms * (grad_w - v32 * (s / (norms * norms)))
    return grad_v.to(v.dtype), (s / norms).to(g.dtype)


def _wrapped_masked_index(
    decomposition: Callable, x: torch.Tensor, mask: torch.Tensor, indices: list, fill: Any
) -> torch.Tensor:
    """``_unsafe_masked_index`` with negative indices wrapped as eager wraps
    them: torch's decomposition clamps indices into ``[0, size)`` (so that
    masked-off positions read in bounds), which makes -1 read element 0."""
    wrapped = [
        None if index is None else torch.where(index < 0, index + x.size(k), index)
        for k, index in enumerate(indices)
    ]
    return decomposition(x, mask, wrapped, fill)


def replace_wrong_composites(gm: torch.fx.GraphModule) -> None:
    """Point calls in a Dynamo graph of torch functions that tracing would
    decompose wrongly at tilec's own version of them, in place.  torch
    registers some decompositions at the Autograd dispatch key: they run
    while AOTAutograd traces, before any backend's table is consulted."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COMPOSITES]
    for node in calls:
        node.target = COMPOSITES[node.target]
    if calls:
        gm.recompile()


def _multilabel_margin_loss(
    x: torch.Tensor,
    target: torch.Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Eager's ``F.multilabel_margin_loss``: a sample's targets are its labels
    before the first -1, and its loss sums ``max(0, 1 - (x[t] - x[i])) / C``
    over targets ``t`` and non-target classes ``i``.  (torch's decomposition
    also counts the labels after the -1.)"""
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    rows, labels = torch.atleast_2d(x), torch.atleast_2d(target)
    classes = rows.shape[-1]
    positions = torch.arange(classes, device=x.device)
    end = torch.where(labels == -1, positions, classes).amin(dim=-1, keepdim=True)
    counted = positions < end  # [N, j]: label j comes before the first -1
    safe = torch.where(counted, labels, 0)
    # [N, j, i]: label j of the sample is class i.
    hit = (safe.unsqueeze(-1) == positions) & counted.unsqueeze(-1)
    margins = (1 - torch.gather(rows, -1, safe).unsqueeze(-1) + rows.unsqueeze(1)).clamp_min(0)
    keep = counted.unsqueeze(-1) & ~hit.any(dim=1).unsqueeze(1)
    loss = torch.where(keep, margins / classes, 0).sum(dim=(1, 2))
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss.reshape(x.shape[:-1])


def _multi_margin_loss(
    x: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """Eager's ``F.multi_margin_loss``: one sample (an input of at most one
    dimension) with ``reduction="none"`` has a loss of its target's shape,
    () or (1,), which torch's decomposition always returns as (1,) (its
    values are eager's)."""
    loss = F.multi_margin_loss(x, target, *args, **kwargs)
    return loss.reshape(target.shape) if x.dim() <= 1 and loss.dim() == 1 else loss


COMPOSITES = {
    F.multilabel_margin_loss: _multilabel_margin_loss,
    F.multi_margin_loss: _multi_margin_loss,
}
