"""Freezing: parameters and buffers become constants of the graph.

With ``options={"freeze": True}`` tilec treats the model's parameters and
buffers as compile-time constants, so the constant-folding pass can compute
everything that depends on them alone (weight casts, batch norm folded into
the convolution before it) once.  Dynamo does not guard on parameter values:
a frozen program keeps the values it was compiled with, so freezing is
opt-in and meant for inference on weights that no longer change.

Dynamo hands parameters and buffers to the backend as graph inputs; which
inputs they are is read off each placeholder's source
(``L['self']._modules['fc']._parameters['weight']``).  AOTAutograd keeps the
order of the inputs in the ATen graph it builds, so the same positions are
replaced there by ``get_attr`` constants holding the real tensors.  Each
keeps the parameter's name, its module path read off the same source
(``fc.weight``), in its ``meta[NAME_META]``: lowering records it in
``Graph.constant_names``, where passes that treat layers by name
(quantization's skip patterns) and the dumps read it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx

_PARAM_OR_BUFFER = re.compile(r"\._(parameters|buffers)\[")
# One step of a module path in a source: ``._modules['fc']``, ``._parameters['weight']``.
_PATH_STEP = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")
# The key of a frozen constant's FX meta that holds the parameter's name.
NAME_META = "tilec_parameter"


class Frozen(NamedTuple):
    """A parameter or buffer frozen into a constant: its module path and value."""

    name: str
    tensor: torch.Tensor


def parameter_name(source: str) -> str:
    """``L['self']._modules['fc']._parameters['weight']`` -> ``fc.weight``."""
    return ".".join(_PATH_STEP.findall(source))


def frozen_inputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> dict[int, Frozen]:
    """Positions of the Dynamo graph's inputs that are parameters or buffers,
    with their names and real tensors.  Refuses parameters that would need
    gradients."""
    frozen: dict[int, Frozen] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, (node, value) in enumerate(zip(placeholders, example_inputs)):
        arg = node.meta.get("grapharg")
        if arg is None or not isinstance(value, torch.Tensor):
            continue
        source = arg.source.name
        source = source() if callable(source) else source  # a method in older torch
        if not _PARAM_OR_BUFFER.search(source):
            continue
        if value.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"tilec: options={{'freeze': True}} is for inference, but {source} requires "
                "grad here; compile and call the model under torch.no_grad() or "
                "torch.inference_mode()"
            )
        frozen[k] = Frozen(parameter_name(source), value.detach())
    return frozen


def freeze_graph(
    gm: torch.fx.GraphModule, inputs: list[Any], frozen: dict[int, Frozen]
) -> tuple[torch.fx.GraphModule, list[Any], list[int]]:
    """Replace the ATen graph's frozen placeholders by constants.

    Returns the new graph, its remaining example inputs and the positions of
    the runtime arguments it still takes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs) or max(frozen, default=-1) >= len(placeholders):
        raise RuntimeError(
            f"tilec: cannot freeze: the ATen graph takes {len(placeholders)} inputs where "
            f"Dynamo passed {len(inputs)}"
        )
    first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
    # A buffer the graph writes (copy_ into it) is state, not a constant.
    written = {n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default}
    keep = []
    for k, node in enumerate(placeholders):
        if k not in frozen or node in written:
            keep.append(k)
            continue
        name, tensor = frozen[k]
        fake = node.meta.get("val")
        if not isinstance(fake, torch.Tensor) or (fake.shape, fake.dtype) != (
            tensor.shape,
            tensor.dtype,
        ):
            raise RuntimeError(
                f"tilec: cannot freeze input {k} ({node.name}): the ATen graph expects "
                f"{fake!r}, the parameter is {tuple(tensor.shape)} {tensor.dtype}"
            )
        attr = f"_tilec_frozen_{k}"
        gm.register_buffer(attr, tensor, persistent=False)
        with gm.graph.inserting_before(first_op):
            const = gm.graph.get_attr(attr)
        const.meta.update(node.meta)
        const.meta[NAME_META] = name
        node.replace_all_uses_with(const)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm, [inputs[k] for k in keep], keep


def drop_frozen(program: Callable, keep: list[int]) -> Callable:
    """``program`` called with the full argument list AOTAutograd passes."""

    def run(*args: Any) -> Any:
        return program(*(args[k] for k in keep))

    return run
