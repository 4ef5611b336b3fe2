"""The decomposition table AOTAutograd applies before lowering.

Core ATen decompositions, plus composite ops that tilec prefers to see as
their parts, so that fusion can put them back together as one kernel:
norms and softmax become reductions and pointwise ops, activations become
pointwise math.  Ops tilec lowers natively (embedding, index_select, repeat,
...) are left alone.
"""

from __future__ import annotations

import torch
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


def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(EXTRA))
    for op in KEEP + LIBRARY:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    return table
