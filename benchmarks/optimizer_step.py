"""An optimizer step over a zoo model's parameters, compiled for the GPU
target without a GPU: launches, fallbacks, bytes and predicted time.

    python -m benchmarks.optimizer_step [--model gpt2] [--size full]
        [--optimizer AdamW] [--foreach | --no-foreach]

The model is built (random weights) on the CPU, each parameter gets a
random gradient, and ``optimizer.step()`` is compiled by tilec for the H100
target (``benchmarks.static.tilec_graphs``: nothing runs).  ``--foreach``
(the default) is torch's multi-tensor implementation, its default for CUDA
tensors; ``--no-foreach`` its loop over parameters.  Inductor's side is not
here (it needs the optimizer state on a GPU).  Times are PREDICTIONS of
tilec's cost model, each launch priced outside a CUDA graph.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.static import NOTICE, kernel_prediction, tilec_graphs
from benchmarks.zoo import MODELS

OPTIMIZERS = {
    "AdamW": lambda params, foreach: torch.optim.AdamW(params, lr=1e-3, foreach=foreach),
    "Adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-3, foreach=foreach),
    "SGD": lambda params, foreach: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach),
}


def optimizer_step(model: str, size: str, optimizer: str, foreach: bool) -> dict[str, Any]:
    """Launches, fallbacks, kernel bytes and predicted seconds of one compiled
    step (the steady state: after the first, which creates the state)."""
    params = list(MODELS[model].build(size).model.parameters())
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    opt = OPTIMIZERS[optimizer](params, foreach)
    opt.step()  # eagerly: the state exists, as in every step but the first
    t0 = time.perf_counter()
    (captured,) = tilec_graphs(opt.step, ())
    kernels = captured.kernels
    return {
        "model": model,
        "size": size,
        "optimizer": optimizer,
        "foreach": foreach,
        "parameters": len(params),
        "launches": len(kernels),
        "parts": [len(k.group.parts) for k in kernels],
        "fallbacks": captured.fallbacks,
        "kernel_bytes": sum(k.bytes_read + k.bytes_written for k in kernels),
        "predicted_s": sum(kernel_prediction(k).seconds for k in kernels),
        "compile_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--optimizer", default="AdamW", choices=sorted(OPTIMIZERS))
    parser.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    print(NOTICE)
    r = optimizer_step(args.model, args.size, args.optimizer, args.foreach)
    print(
        f"{r['model']} ({r['size']}), {r['optimizer']} "
        f"({'foreach' if r['foreach'] else 'loop'}), {r['parameters']} parameters: "
        f"{r['launches']} launches (parts {r['parts']}), fallbacks {r['fallbacks'] or 'none'}, "
        f"{r['kernel_bytes'] / 1e6:.1f} MB, predicted {r['predicted_s'] * 1e6:.1f} us; "
        f"compiled in {r['compile_s']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
