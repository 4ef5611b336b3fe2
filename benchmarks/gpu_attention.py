"""The ``attention`` section of ``benchmarks.gpu_check``: tilec's attention
template against torch's fused attention.

For each shape (batch, heads, sequence, head dimension): causal
``flex_attention`` compiled with tilec (one attention kernel, launched
alone, cold L2) against ``scaled_dot_product_attention(is_causal=True)``
(torch's flash kernel on a GPU), both timed alone; the template's output
against SDPA's, and the cost model's prediction for the kernel beside the
measurement.  TFLOP/s are counted on the full square for the template
(``template_tflops_full_square``, comparable with the runs before it
skipped masked tiles) and on the causal half for SDPA, the work it does.

The backward (``backward``): the same attention trained through tilec, its
two backward kernels (dq; dk and dv) each launched alone, against SDPA's
forward and backward less its forward; gradients against float32 SDPA's.
On a CPU torch refuses FlexAttention inputs that need gradients: skipped,
saying so.

Decode (``decode``, first: the prefill rows were measured before): one
query row of grouped-query attention against a long cache, as a decode
step reads it, compiled with each of the config's ``chunks`` (the option
``attention_chunks``; None: the cost model's choice), the split kernel
timed alone beside its prediction and the key blocks each of its programs
walks.  The cost model prices a block as a GEMV's measured K step
(``cost.KEY_STEPS``, assumed); ``key_block_s``, the least-squares slope of
the times against the blocks, measures it.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tilec
from benchmarks.gpu_check import predicted_seconds
from benchmarks.gpu_kernels import launch_record
from benchmarks.gpu_timing import (
    Section,
    capture_launches,
    failure,
    release,
    time_calls,
    time_launch,
)
from benchmarks.measure import DTYPES
from benchmarks.static import GPU


def _causal(b, h, q, kv):
    return q >= kv


def attention(s: Section) -> None:
    s.data["decode"] = []
    for shape in s.cfg["decode_shapes"]:
        for chunks in s.cfg["decode_chunks"]:
            name = f"decode {'x'.join(map(str, shape))} chunks={chunks}"
            if s.out_of_time(s.cfg["item_min_s"], name):
                continue
            try:
                row = _decode(s, *shape, chunks)
            except Exception:
                row = {"error": failure()}
            s.data["decode"].append({"shape": shape, "chunks": chunks, **row})
            s.save()
            release()
    s.data["key_block_s"] = key_block_seconds(s.data["decode"])
    s.data["rows"] = []
    for batch, heads, length, dim in s.cfg["shapes"]:
        name = f"{batch}x{heads}x{length}x{dim}"
        if s.out_of_time(s.cfg["item_min_s"], name):
            continue
        try:
            row = _attention(s, batch, heads, length, dim)
        except Exception:
            row = {"error": failure()}
        s.data["rows"].append({"shape": [batch, heads, length, dim], **row})
        s.save()
        release()


def _decode(
    s: Section, batch: int, heads: int, kv_heads: int, keys: int, dim: int, chunks: int | None
) -> dict[str, Any]:
    """One decode row's attention split into ``chunks`` (None: the cost
    model's choice): the split kernel timed alone, its prediction, and the
    key blocks each program walks; the output (split and combine) against
    float32 SDPA."""
    cfg, device, dtype = s.cfg, s.device, DTYPES[s.cfg["dtype"]]
    generator = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype, generator=generator)
    k, v = (
        torch.randn(batch, kv_heads, keys, dim, device=device, dtype=dtype, generator=generator)
        for _ in range(2)
    )
    group = heads // kv_heads

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # transformers' repeat_kv: each key head expanded over its query heads
        k, v = (
            t[:, :, None].expand(batch, kv_heads, group, keys, dim).reshape(batch, heads, keys, dim)
            for t in (k, v)
        )
        return F.scaled_dot_product_attention(q, k, v)

    torch._dynamo.reset()
    before = set(tilec.programs())
    compiled = torch.compile(
        fn, backend="tilec", dynamic=False, options={"attention_chunks": chunks}
    )
    with torch.no_grad():
        out = compiled(q, k, v)
        (program,) = [p for name, p in tilec.programs().items() if name not in before]
        (step,) = [step for step in program.launches() if step.kernel.template == "attention"]
        launches = capture_launches(program, lambda: compiled(q, k, v))
    launcher, args = launches[step.kernel.name]
    timing = time_launch(launcher, args, device, cfg["runs"], cfg["warmup"], 1)
    expected = fn(q.float(), k.float(), v.float())
    loop = step.kernel.program_loop
    sm_count = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device == "cuda"
        else GPU.sm_count
    )
    return {
        "sm_count": sm_count,
        "split": timing,
        "launch": launch_record(step),
        "key_blocks": loop.steps if loop is not None else None,
        "resident": loop.resident if loop is not None else None,
        "predicted_s": predicted_seconds(step.kernel),
        "launches": len(program.launches()),
        "max_error": (out.float() - expected).abs().max().item(),
    }


def key_block_seconds(rows: list[dict[str, Any]]) -> float | None:
    """The least-squares slope of the split kernels' times against the key
    blocks their programs walk (rows of one wave: every program resident at
    once), or None with fewer than two distinct counts."""
    points = [
        (r["key_blocks"], r["split"]["median_s"])
        for r in rows
        if "error" not in r
        and r["key_blocks"]
        and math.prod(r["launch"]["grid"]) <= r["resident"] * r["sm_count"]
    ]
    if len({x for x, _ in points}) < 2:
        return None
    return statistics.linear_regression(*zip(*points)).slope


def _attention(s: Section, batch: int, heads: int, length: int, dim: int) -> dict[str, Any]:
    cfg, device, dtype = s.cfg, s.device, DTYPES[s.cfg["dtype"]]
    generator = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, length, dim, device=device, dtype=dtype, generator=generator)
        for _ in range(3)
    )
    mask = create_block_mask(_causal, None, None, length, length, device=device)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex_attention(q, k, v, block_mask=mask)

    library = time_calls(
        lambda _: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        device,
        cfg["runs"],
        cfg["warmup"],
    )
    torch._dynamo.reset()
    before = set(tilec.programs())
    t0 = time.perf_counter()
    compiled = torch.compile(fn, backend="tilec", dynamic=False)
    with torch.no_grad():
        out = compiled(q, k, v)
    compile_s = time.perf_counter() - t0
    (program,) = [p for name, p in tilec.programs().items() if name not in before]
    (step,) = [step for step in program.launches() if step.kernel.template == "attention"]
    with torch.no_grad():  # as compiled: grad mode is one of Dynamo's guards
        launches = capture_launches(program, lambda: compiled(q, k, v))
    launcher, args = launches[step.kernel.name]
    template = time_launch(launcher, args, device, cfg["runs"], cfg["warmup"], 1)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    full = 4 * batch * heads * length * length * dim
    try:
        backward = _backward(s, fn, q, k, v, library["median_s"])
    except Exception:
        backward = {"error": failure()}
    return {
        "backward": backward,
        "library": library,
        "template": template,
        "template_compile_s": compile_s,
        "template_launch": launch_record(step),
        "predicted_s": predicted_seconds(step.kernel),
        "template_tflops_full_square": full / template["median_s"] / 1e12,
        "library_tflops_causal": full / 2 / library["median_s"] / 1e12,
        "template_vs_library": library["median_s"] / template["median_s"],
        "template_max_error": (out.float() - expected).abs().max().item(),
        "library_max_error": (
            F.scaled_dot_product_attention(q, k, v, is_causal=True).float() - expected
        )
        .abs()
        .max()
        .item(),
    }


def _backward(
    s: Section, fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_s: float
) -> dict[str, Any]:
    """The backward kernels of ``fn`` (causal flex_attention) through tilec,
    each launched alone, against SDPA's backward (its forward and backward
    timed together, less ``forward_s``, its forward alone)."""
    cfg, device = s.cfg, s.device
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn_like(q)
    torch._dynamo.reset()
    before = set(tilec.programs())
    compiled = torch.compile(fn, backend="tilec", dynamic=False)
    try:
        grads = torch.autograd.grad(compiled(*leaves), leaves, grad_out)
    except NotImplementedError as e:  # on a CPU, torch refuses inputs that need gradients
        return {"skipped": str(e)}
    (program,) = [
        p for name, p in tilec.programs().items() if name not in before and "backward" in name
    ]
    steps = [step for step in program.launches() if step.kernel.template == "attention_grad"]
    launches = capture_launches(
        program, lambda: torch.autograd.grad(compiled(*leaves), leaves, grad_out)
    )
    kernels = {}
    for step in steps:
        launcher, args = launches[step.kernel.name]
        timing = time_launch(launcher, args, device, cfg["runs"], cfg["warmup"], 1)
        kernels[step.kernel.name] = {
            **timing,
            "launch": launch_record(step),
            "predicted_s": predicted_seconds(step.kernel),
        }

    def sdpa_grads(*inputs: torch.Tensor) -> tuple:
        out = F.scaled_dot_product_attention(*inputs, is_causal=True)
        return torch.autograd.grad(out, inputs, grad_out.to(out.dtype))

    library = time_calls(lambda _: sdpa_grads(*leaves), device, cfg["runs"], cfg["warmup"])
    exact = sdpa_grads(*(t.detach().float().requires_grad_() for t in (q, k, v)))
    ours = sum(kernel["median_s"] for kernel in kernels.values())
    library_s = library["median_s"] - forward_s
    return {
        "kernels": kernels,
        "template_s": ours,
        "predicted_s": sum(kernel["predicted_s"] for kernel in kernels.values()),
        "library_forward_backward": library,
        "library_s": library_s,
        "template_vs_library": library_s / ours,
        "max_error": [(g.float() - e).abs().max().item() for g, e in zip(grads, exact)],
        "library_max_error": [
            (g.float() - e).abs().max().item() for g, e in zip(sdpa_grads(*leaves), exact)
        ],
    }
