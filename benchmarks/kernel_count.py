"""Kernels per transformer block: tilec against Inductor.

Compiles one GPT-2-style block (``examples/tiny_gpt.py``) for inference with
each backend and prints how many kernels each generated.  Run from the repo
root: ``python -m benchmarks.kernel_count``.

tilec's count is its Triton kernels (``tilec.stats()["kernels"]``); library
calls (matmul) are not kernels it generates.  Inductor's is
``torch._inductor.metrics.generated_kernel_count``: C++ kernels on a CPU,
Triton kernels on a GPU.  On a CPU that metric counts every loop nest Inductor
emits (a vectorized body and its scalar tail are two), so the kernel
*functions* in its output code are counted too: those are what it launches.
Inductor's caches are off so that it really generates (a cache hit
generates, and counts, nothing): a cold compile takes ~20 s on a CPU.
"""

from __future__ import annotations

import torch
import torch._functorch.config
import torch._inductor.config
from torch._inductor import metrics
from torch._inductor.utils import run_and_get_code

import tilec
from examples.tiny_gpt import Block, GPTConfig


def block_and_input(device: str = "cpu") -> tuple[torch.nn.Module, torch.Tensor]:
    """One GPT-2-style block (embedding 64, 4 heads) and a (2, 16, 64) input."""
    torch.manual_seed(0)
    config = GPTConfig()
    return Block(config).eval().to(device), torch.randn(2, 16, config.n_embd, device=device)


def tilec_kernel_count(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Triton kernels tilec generates for ``block`` (after checking it against eager)."""
    torch._dynamo.reset()
    tilec.reset_stats()
    with torch.no_grad():
        out = torch.compile(block, backend="tilec")(x)
        torch.testing.assert_close(out, block(x), atol=1e-4, rtol=1e-4)
    return tilec.stats()["kernels"]


# How a kernel function is defined in Inductor's output code, per device.
KERNEL_DEFINITIONS = {
    "cpu": ("async_compile.cpp_pybinding(", "async_compile.cpp("),
    "cuda": ("async_compile.triton(",),
}


def inductor_kernel_counts(block: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(generated_kernel_count, kernel functions in the output code) for
    ``block``, compiled cold by Inductor."""
    torch._dynamo.reset()
    metrics.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch.no_grad(),
    ):
        _, sources = run_and_get_code(torch.compile(block, backend="inductor"), x)
    generated = metrics.generated_kernel_count
    torch._dynamo.reset()
    markers = KERNEL_DEFINITIONS[x.device.type]
    functions = sum(src.count(m) for src in sources for m in markers)
    return generated, functions


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block, x = block_and_input(device)
    kind = "Triton" if device == "cuda" else "C++"
    ours = tilec_kernel_count(block, x)
    print(f"block: GPT-2-style, embedding 64, 4 heads, input {tuple(x.shape)}, {device}")
    print(f"tilec    Triton kernels: {ours}  (+ library calls: {tilec.stats()['extern_calls']})")
    generated, functions = inductor_kernel_counts(block, x)
    print(
        f"Inductor {kind} kernels: generated_kernel_count={generated}, kernel functions={functions}"
    )


if __name__ == "__main__":
    main()
