"""The zoo's GEMM shapes: the (M, N, K) of every matrix product its models compute.

Each model runs one forward pass on the meta device (no memory, no compute,
seconds for the full-size zoo) under a dispatch mode that records the
operands of ``aten.mm`` and ``aten.addmm``: what linear layers become, and
the same products tilec's lowering sees.  Batched products (attention, which
reaches a GPU as a fused attention kernel) are left out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.measure import DTYPES
from benchmarks.zoo import MODELS

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    dtype: str

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


class _Recorder(TorchDispatchMode):
    def __init__(self, dtype: str) -> None:
        super().__init__()
        self.dtype = dtype
        self.gemms: list[Gemm] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (aten.mm, aten.addmm):
            a, b = args[:2] if packet is aten.mm else args[1:3]
            self.gemms.append(Gemm(a.shape[0], b.shape[1], a.shape[1], self.dtype))
        return func(*args, **(kwargs or {}))


def model_gemms(name: str, size: str, dtype: str, batch: int = 1) -> list[Gemm]:
    """The GEMMs of one forward pass of zoo model ``name``, in call order."""
    spec = MODELS[name]
    with torch.device("meta"):
        model = spec.build(size).model.eval().to(DTYPES[dtype])
    inputs = [
        t.to("meta", DTYPES[dtype] if t.is_floating_point() else t.dtype)
        for t in spec.inputs(size, batch, torch.Generator().manual_seed(0))
    ]
    recorder = _Recorder(dtype)
    with torch.no_grad(), recorder:
        model(*inputs)
    return recorder.gemms


def zoo_gemms(size: str, dtype: str, limit: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """At most ``limit`` distinct GEMMs of the zoo at batch 1, taken in rounds:
    each model's costliest shape not yet taken, then each one's next, so every
    model with a GEMM is represented before any has two.  Returns the shapes
    (with the models that compute each) and the models that failed to run."""
    per_model: dict[str, list[Gemm]] = {}
    failed: dict[str, str] = {}
    users: dict[Gemm, list[str]] = {}
    for name in MODELS:
        try:
            gemms = model_gemms(name, size, dtype)
        except Exception as err:  # one model's shapes missing is a note, not a failure
            failed[name] = f"{type(err).__name__}: {err}"[:500]
            continue
        for g in dict.fromkeys(gemms):
            users.setdefault(g, []).append(name)
        per_model[name] = sorted(set(gemms), key=lambda g: -g.flops)
    chosen: list[Gemm] = []
    while len(chosen) < limit:
        before = len(chosen)
        for gemms in per_model.values():
            fresh = next((g for g in gemms if g not in chosen), None)
            if fresh is not None and len(chosen) < limit:
                chosen.append(fresh)
        if len(chosen) == before:
            break
    rows = [{**dataclasses.asdict(g), "models": users[g]} for g in chosen]
    return rows, failed
