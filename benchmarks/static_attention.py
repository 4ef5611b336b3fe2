"""Predicted attention time per layer: tilec's template against Inductor's choice.

    python -m benchmarks.static_attention [--lengths 1024,8192] [--batches 1,8]

One GPT-2-style attention layer (12 heads, head dimension 64, causal, bf16)
written out as transformers' eager attention writes it (scores, a causal
mask of the float minimum, softmax, product with V).  tilec's side: the
kernels it compiles for the GPU target (``benchmarks.static``'s tracing),
compiled for sm_90 (registers, spills) and priced by the cost model.
Inductor's side: Inductor rewrites this pattern into one
``scaled_dot_product_attention`` call (its fuse_attention patterns), which
runs torch's flash kernel, priced as the static report prices that call
(``cost.attention``: the library attention rate, over the causal half of
the square it computes).  Both are predictions.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.sm90 import compile_kernel
from benchmarks.static import GPU, kernel_prediction, tilec_graphs
from tilec import cost
from tilec.codegen.record import kernel_entry

HEADS, DIM = 12, 64


def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as transformers' eager attention writes it."""
    n = q.shape[-2]
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = torch.where(cols <= rows, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    scores = q @ k.transpose(-1, -2) * DIM**-0.5 + mask
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def predict(batch: int, length: int) -> dict[str, Any]:
    shape = (batch, HEADS, length, DIM)
    q, k, v = (torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3))
    (captured,) = tilec_graphs(layer, (q, k, v))
    kernels = []
    for kernel in captured.kernels:
        compiled = compile_kernel(kernel_entry(captured.graph, kernel.group, kernel, GPU))
        kernels.append(
            {
                "template": kernel.template,
                "bytes": kernel.bytes_read + kernel.bytes_written,
                "flops": kernel.flops,
                "registers": compiled.get("registers"),
                "spill_bytes": compiled.get("spill_bytes"),
                "predicted_s": kernel_prediction(kernel).seconds,
            }
        )
    full = 4 * batch * HEADS * length * length * DIM
    nbytes = 4 * batch * HEADS * length * DIM * 2  # q, k, v read, the output written
    library = cost.attention(GPU, full / 2, nbytes, torch.bfloat16).seconds
    tilec_s = sum(k["predicted_s"] for k in kernels)
    return {
        "batch": batch,
        "length": length,
        "tilec_kernels": kernels,
        "tilec_s": tilec_s,
        "library_calls": sum(1 for n in captured.graph.nodes.values() if n.kind == "extern"),
        "inductor_sdpa_s": library,
        "tilec_over_inductor": tilec_s / library,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,8192")
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args(argv)
    print(f"GPT-2-style attention layer ({HEADS} heads x {DIM}, causal, bf16) on {GPU.name}")
    head = ["batch", "seq", "tilec kernels", "library calls", "bytes", "registers / spills"]
    head += ["tilec us", "Inductor (SDPA) us", "tilec / Inductor"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for batch in (int(b) for b in args.batches.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            r = predict(batch, length)
            ks = r["tilec_kernels"]
            regs = ", ".join(f"{k['registers']} / {k['spill_bytes']}" for k in ks)
            cells = [batch, length, ", ".join(k["template"] for k in ks), r["library_calls"]]
            cells += [f"{sum(k['bytes'] for k in ks):,}", regs, f"{r['tilec_s'] * 1e6:.1f}"]
            cells += [f"{r['inductor_sdpa_s'] * 1e6:.1f}", f"{r['tilec_over_inductor']:.2f}"]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
