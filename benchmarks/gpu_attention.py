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
"""

from __future__ import annotations

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


def _causal(b, h, q, kv):
    return q >= kv


def attention(s: Section) -> None:
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
    return {
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
