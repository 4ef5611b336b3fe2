"""tilec on two built-in models: ``python examples/demo.py [--dump DIR] [--device D]``.

Compiles a small GPT-2-style language model and an MLP with
``torch.compile(..., backend="tilec")``, checks each against eager PyTorch and
reports what tilec made of it: Triton kernels, library calls (matmul), ops
that fell back to ATen, and where the per-pass IR dump went.  Runs on the GPU
when there is one; on a CPU the kernels run in Triton's interpreter (right
answers, not speed).  Exits non-zero when a result does not match eager.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tiny_gpt import GPTConfig, TinyGPT  # a sibling file: the script's folder is on sys.path
from torch import nn

import tilec

TOLERANCE = 1e-4


def run_example(
    name: str, model: nn.Module, inputs: tuple[torch.Tensor, ...], dump: Path, device: str
) -> bool:
    """Compile ``model`` with tilec, compare with eager, print a report; True if it matches."""
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    torch._dynamo.reset()
    tilec.reset_stats()
    compiled: Callable = torch.compile(model, backend="tilec", options={"dump": str(dump / name)})
    with torch.no_grad():
        expected = model(*inputs)
        actual = compiled(*inputs)
    error = (actual - expected).abs().max().item()
    ok = actual.shape == expected.shape and error <= TOLERANCE * (1 + expected.abs().max().item())
    s = tilec.stats()
    fallbacks = ", ".join(f"{op} x{n}" for op, n in sorted(s["fallbacks"].items())) or "none"
    print(
        f"{name}: {'matches eager' if ok else 'DOES NOT MATCH eager'} (max abs error {error:.2e})"
    )
    print(f"  graphs compiled: {s['graphs']}")
    print(f"  Triton kernels:  {s['kernels']}")
    print(f"  library calls:   {s['extern_calls']}")
    print(f"  ATen fallbacks:  {fallbacks}")
    print(f"  IR dump:         {dump / name}  (per-pass IR, kernels/, summary.txt)")
    print(f"  kernels ran:     {_where_kernels_run(device)}")
    return ok


def _where_kernels_run(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"on {torch.cuda.get_device_name(device)}, compiled by Triton"
    return "on the CPU, in Triton's interpreter (checks results; says nothing about speed)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, default=Path("tilec-dump"), help="IR dump directory")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device to run on (default: cuda if there is a GPU, else cpu)",
    )
    args = parser.parse_args()
    dump = args.dump.resolve()
    torch.manual_seed(0)
    config = GPTConfig()
    gpt = TinyGPT(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    mlp = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    ).eval()
    results = [
        run_example("tiny_gpt", gpt, (ids,), dump, args.device),
        run_example("mlp", mlp, (torch.randn(8, 32),), dump, args.device),
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
