"""What the backward gets from the forward: saved, or recomputed.

AOTAutograd traces forward and backward as one joint graph and splits it in
two; the values of the forward that the backward reads either cross the
split (the forward stores them, and they live until the backward runs) or
are computed again in the backward from what does cross.  Option
``partitioner``:

* ``"min_cut"`` (the default): torch's min-cut rematerialization
  partitioner, as Inductor uses it.  It saves the cheapest set of values
  from which the backward can recompute the rest, recomputing only ops
  that fusion makes nearly free (pointwise ops, and reductions and views
  near them), never random ops or matmuls.  A GELU's input is saved, its
  output recomputed inside the backward kernel that reads it.
* ``"save_all"``: torch's default partitioner: every forward value the
  backward reads is saved.

A read of an input that the graph writes (``b.clamp_(...)`` after ``y = w
* (b + 1)``) is never recomputed: the backward runs after the call has
written the input's new value, so recomputing ``b + 1`` there reads the
new ``b`` and gives a wrong gradient, silently (torch 2.13 and 2.14's
min-cut partitioner does so, for Inductor too).  Such reads are marked
``MUST_SAVE`` before the min-cut split (:func:`_pin_reads_of_written_inputs`),
looking through views to the op that reads the values.

Each split is recorded (:class:`Split`): the values saved and their bytes,
the forward ops the backward recomputes, and the bytes ``save_all`` would
have saved; each of the forward graph's dump folders has it as
``partition.txt``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._functorch._aot_autograd.descriptors import (
    InputMutationAOTOutput,
    SavedForBackwardsAOTOutput,
)
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy


@dataclasses.dataclass
class Split:
    """One joint graph's split (module docstring).  ``saved``: (name, bytes)
    of each tensor the forward saves that is not one of its inputs (an
    activation); ``saved_bytes``: their memory, each storage once (a view
    and its base are one); ``recomputed``: the forward ops the backward
    computes again, by node name and op; ``save_all_bytes``: the memory had
    every forward value the backward reads been saved."""

    partitioner: str
    saved: list[tuple[str, int]]
    saved_bytes: int
    recomputed: list[tuple[str, str]]
    save_all_bytes: int

    def text(self) -> str:
        lines = [
            f"partitioner: {self.partitioner}",
            f"activations saved for the backward: {len(self.saved)}, {self.saved_bytes} bytes "
            f"(saving every forward value the backward reads: {self.save_all_bytes} bytes)",
            "",
            "saved:",
            *(f"  %{name}  {nbytes} bytes" for name, nbytes in self.saved),
            "",
            f"recomputed in the backward: {len(self.recomputed)}",
            *(f"  %{name} = {op}" for name, op in self.recomputed),
        ]
        return "\n".join(lines) + "\n"


def partition_fn(partitioner: str, splits: list[Split]) -> Callable:
    """AOTAutograd's ``partition_fn`` for option ``partitioner``; appends the
    :class:`Split` of each joint graph it splits to ``splits``."""

    def partition(
        joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        # What saving everything would keep (the default partitioner leaves
        # the joint graph as it found it, but for dead code).
        fw, bw = default_partition(joint, joint_inputs, **kwargs)
        _, save_all = _saved(fw, kwargs["num_fwd_outputs"])
        if partitioner == "min_cut":
            _pin_reads_of_written_inputs(joint)
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        saved, saved_bytes = _saved(fw, kwargs["num_fwd_outputs"])
        # Computed in the forward, and again in the backward.
        forward = {n.name for n in fw.graph.nodes if n.op == "call_function"}
        recomputed = [
            (n.name, _op_name(n))
            for n in bw.graph.nodes
            if n.op == "call_function" and n.name in forward
        ]
        splits.append(Split(partitioner, saved, saved_bytes, recomputed, save_all))
        return fw, bw

    return partition


def saved_outputs(forward: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the outputs of a training ``forward`` that only its
    backward reads: the activations AOTAutograd saves with
    ``save_for_backward`` (``SavedForBackwardsAOTOutput``), which autograd
    lets go of once the backward ran.  Those it keeps on the autograd node
    instead (``SavedForBackwardsNoVcCheckAOTOutput``), which live as long
    as the node does, are not among them."""
    (output,) = forward.graph.find_nodes(op="output")
    descs = output.meta.get("desc") or ()
    return frozenset(k for k, d in enumerate(descs) if isinstance(d, SavedForBackwardsAOTOutput))


def _pin_reads_of_written_inputs(joint: torch.fx.GraphModule) -> None:
    """Marks ``MUST_SAVE`` each op of ``joint`` that reads an input the graph
    writes (module docstring), through views of it.  AOTAutograd writes an
    input in the graph (``copy_`` into its placeholder: an input that needs
    no gradient) or returns its new value for the call to copy
    (``InputMutationAOTOutput``, naming the input's descriptor)."""
    (output,) = joint.graph.find_nodes(op="output")
    descs = output.meta.get("desc") or ()
    returned = {d.mutated_input for d in descs if isinstance(d, InputMutationAOTOutput)}
    placeholders = joint.graph.find_nodes(op="placeholder")
    written = [n for n in placeholders if n.meta.get("desc") in returned]
    written += [
        n.args[0]
        for n in joint.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
        if n.args[0] in placeholders
    ]
    todo = list(dict.fromkeys(written))
    while todo:
        for user in todo.pop().users:
            if user.op != "call_function" or user.target is torch.ops.aten.copy_.default:
                continue
            if isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
                todo.append(user)  # a view aliases the input: its readers read it
            elif "recompute" not in user.meta:
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _saved(fw: torch.fx.GraphModule, outputs: int) -> tuple[list[tuple[str, int]], int]:
    """The activations forward graph ``fw`` saves for the backward (its
    outputs after the first ``outputs``) that are not its inputs or views
    of them: (name, bytes) of each, and their memory, each storage once."""
    inputs = {
        StorageWeakRef(n.meta["val"].untyped_storage())
        for n in fw.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    }
    (output,) = [n for n in fw.graph.nodes if n.op == "output"]
    saved: list[tuple[str, int]] = []
    storages: dict[StorageWeakRef, int] = {}
    for node in output.args[0][outputs:]:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        storage = StorageWeakRef(val.untyped_storage())
        if storage in inputs:
            continue
        saved.append((node.name, _nbytes(node)))
        storages[storage] = _hint(val.untyped_storage().nbytes())
    return saved, sum(storages.values())


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return _hint(val.numel()) * val.element_size()


def _op_name(node: torch.fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _hint(value: int | torch.SymInt) -> int:
    """A size, or a symbolic size's value in the example the graph was traced with."""
    if isinstance(value, torch.SymInt):
        node = value.node
        return int(node.hint if node.hint is not None else node.shape_env.size_hint(node.expr))
    return int(value)
