"""Memory figures of tilec's static plans on the model zoo.

    python -m benchmarks.memory [--models gpt2,resnet18] [--size tiny|full]

For each model compiled for inference: the planned arena of every compiled
graph against the sum of its intermediates and the naive peak (allocate at
first write, free after last read).  On a GPU it also measures, for tilec and
for Inductor, the peak memory one call allocates beyond what was allocated
before it (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import sys

import torch

import tilec
from benchmarks.zoo import MODELS
from tilec.passes.memory_plan import figures


def _call_peak(fn, inputs: tuple) -> int:
    """Bytes one call allocates at its peak, beyond what is allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def model_figures(name: str, size: str, device: str, batch: int) -> dict[str, int]:
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.build(size).model.eval().to(device)
    inputs = tuple(t.to(device) for t in spec.inputs(size, batch, torch.Generator().manual_seed(0)))
    torch._dynamo.reset()
    earlier = set(tilec.programs())
    compiled = torch.compile(model, backend="tilec")
    with torch.no_grad():
        compiled(*inputs)
        plans = [figures(p.graph.memory) for n, p in tilec.programs().items() if n not in earlier]
        row = {key: sum(p[key] for p in plans) for key in plans[0]} if plans else {}
        if device == "cuda":
            row["tilec_call_peak_bytes"] = _call_peak(compiled, inputs)
            torch._dynamo.reset()
            inductor = torch.compile(model, backend="inductor")
            inductor(*inputs)
            row["inductor_call_peak_bytes"] = _call_peak(inductor, inputs)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,resnet18,gpt2,llama,bert")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=("tiny", "full"), default=None)
    parser.add_argument("--batch", type=int, default=None)
    args = parser.parse_args(argv)
    size = args.size or ("full" if args.device == "cuda" else "tiny")
    batch = args.batch or (8 if size == "full" else 2)
    torch.backends.mha.set_fastpath_enabled(False)
    keys = ["arena_bytes", "naive_peak_bytes", "intermediate_bytes", "planned_buffers"]
    if args.device == "cuda":
        keys += ["tilec_call_peak_bytes", "inductor_call_peak_bytes"]
    print(f"memory plans ({size}, batch {batch}, {args.device})")
    print(f"{'model':<16}" + "".join(f"{k:>26}" for k in keys))
    for name in args.models.split(","):
        row = model_figures(name, size, args.device, batch)
        print(f"{name:<16}" + "".join(f"{row.get(k, '-'):>26}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
