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

import dataclasses
import hashlib

import sympy

from tilec import index as ix
from tilec.codegen.emit import KernelArg
from tilec.codegen.launch import LaunchConfig
from tilec.codegen.metrics import kernel_metrics
from tilec.codegen.templates import tile
from tilec.codegen.triton_ops import PRELUDE
from tilec.ir import Graph, Group
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

    @property
    def bytes_read(self) -> int:
        return sum(self.reads.values())


def write_kernel(graph: Graph, group: Group, target: Target) -> KernelSource:
    tiled = tile(graph, group, target)
    body = tiled.emitter
    metrics = kernel_metrics(graph, group, body, tiled.recomputed, tiled.reduction_flops)
    # Inputs, then outputs (a stable sort keeps each in first-use order),
    # then sizes: in0, in1, ..., out0, ..., size0, ...
    order = sorted(body.args.values(), key=lambda a: a[1].is_output)
    params = [name for name, _ in order] + list(body.sizes.values())
    constexprs = [f"{name}: tl.constexpr" for name in tiled.launch.constexprs]
    signature = ", ".join([*params, *constexprs])
    text = "\n".join(body.lines)
    # Named by content: identical kernels have one source and one cache file.
    function = "tilec_" + hashlib.sha256(f"{signature}\n{text}".encode()).hexdigest()[:12]
    imports = ["import triton", "import triton.language as tl"]
    if "libdevice." in text:
        imports.append("from triton.language.extra import libdevice")
    header = ["@triton.jit", f"def {function}({signature}):"]
    source = "\n".join(imports) + "\n" + PRELUDE + "\n\n" + "\n".join(header + body.lines) + "\n"
    return KernelSource(
        f"tilec_{group.name}",
        function,
        group,
        source,
        tuple(arg for _, arg in order),
        tuple(params),
        tuple(body.sizes),
        tiled.xnumel,
        tiled.rnumel,
        tiled.template,
        tiled.launch,
        reads=metrics.reads,
        bytes_written=metrics.bytes_written,
        flops=metrics.flops,
    )
