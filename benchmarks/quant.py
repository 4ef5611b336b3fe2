"""Weight quantization: linear-weight bytes and logits error per scheme.

    python -m benchmarks.quant [--models gpt2,llama] [--size tiny|small|full]
        [--batch N] [--seq N] [--quantize-head] [--json FILE] [--check]

The zoo's GPT-2 and LLaMA-style models (``benchmarks/zoo.py``, random
weights; ``small`` is a size of this benchmark's own between the zoo's
``tiny`` and ``full``, the default on a CPU: every linear layer's input
features are a multiple of 128, so int4 quantizes every layer at every
group size) are frozen and compiled by tilec without quantization and with
each scheme: ``int8_weight_only``, ``int4_weight_only`` at group sizes 32,
64 and 128, and ``fp8`` where the device has fp8 matmuls (CUDA, compute
capability 8.9 or newer; elsewhere the row says it is not available).  The
output head stays in floating point unless ``--quantize-head``.  Per model
and scheme:

* ``linear_weight_bytes``: bytes of the constants the compiled program's
  matmuls read as weights (``passes.quantize.linear_weight_bytes`` on the
  program's graph: measured, not computed from a formula), and its ratio to
  the unquantized program's;
* ``layers_quantized`` / ``layers_skipped``: from the quantization pass's log;
* ``rmse_fp64``: RMSE of the logits against the model run eagerly in float64;
* ``rmse_float``: RMSE against the unquantized tilec program's logits, and
  ``relative_rmse_float``, the same over the RMS of those logits;
* ``top1_agreement``: share of positions whose most likely next token is the
  unquantized tilec program's.

``--check`` is the quick CPU check the test suite runs: tiny models.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import shlex
import sys
from typing import Any

import torch
import triton

import tilec
from benchmarks.progress import Progress
from benchmarks.zoo import MODELS, Logits
from tilec.decisions import of_stage
from tilec.options import Options, check_target
from tilec.passes.quantize import linear_weight_bytes
from tilec.target import Target

DECODERS = ("gpt2", "llama")
SCHEMES = (
    ("none", None),
    ("int8_weight_only", None),
    ("int4_weight_only", 32),
    ("int4_weight_only", 64),
    ("int4_weight_only", 128),
    ("fp8", None),
)
# ``small``: larger than the zoo's tiny, and every input feature count a multiple of 128.
SMALL = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=1024, n_positions=128, n_embd=256,
             n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(vocab_size=1024, hidden_size=256,
              intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)),
}  # fmt: skip
SEQ = {"tiny": 16, "small": 64, "full": 256}


def build(name: str, size: str) -> torch.nn.Module:
    """The zoo's model (``tiny``, ``full``) or this benchmark's ``small`` one, returning logits."""
    if size != "small":
        return MODELS[name].build(size).model.eval()
    import transformers

    model_class, config_class, config = SMALL[name]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    return Logits(model, ("input_ids",), "logits").eval()


def compile_logits(
    model: torch.nn.Module, ids: torch.Tensor, options: dict[str, Any]
) -> tuple[torch.Tensor, Any]:
    """Logits of ``model`` frozen and compiled with ``options``, and the program's graph."""
    before = set(tilec.programs())
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="tilec", options=options)
    with torch.no_grad():
        logits = compiled(ids)
    (program,) = [p for name, p in tilec.programs().items() if name not in before]
    return logits, program.graph


def unavailable(scheme: str, device: torch.device) -> str | None:
    """Why ``scheme`` cannot run on ``device`` (None: it can)."""
    if scheme == "none":
        return None
    try:
        check_target(Options(quantize=scheme, freeze=True), Target.for_device(device))
    except ValueError:
        return "not available on this target (fp8 needs CUDA compute capability >= 8.9)"
    return None


def measure_model(
    name: str,
    size: str,
    batch: int,
    seq: int,
    head: bool,
    device: torch.device,
    progress: Progress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    torch.manual_seed(0)
    model = build(name, size).to(device)
    vocab = model.model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(ids)
    base = {"freeze": True}
    progress.start(f"{name} none")
    float_logits, float_graph = compile_logits(model, ids, base)
    progress.end()
    float_bytes = linear_weight_bytes(float_graph)
    float_rms = float_logits.double().pow(2).mean().sqrt().item()
    rows, skipped = [], []
    for scheme, group in SCHEMES:
        label = scheme if group is None else f"{scheme}:{group}"
        reason = unavailable(scheme, device)
        if reason is not None:
            skipped.append({"model": name, "scheme": label, "reason": reason})
            continue
        if scheme == "none":
            logits, graph = float_logits, float_graph
        else:
            options = {**base, "quantize": scheme, "quantize_head": head}
            if group is not None:
                options["quantize_group_size"] = group
            progress.start(f"{name} {label}")
            logits, graph = compile_logits(model, ids, options)
            progress.end()
        log = of_stage(graph.decisions, "quantize")
        skips = [d.text() for d in log if d.outcome == "skipped"]
        weight_bytes = linear_weight_bytes(graph)
        agreement = (logits.argmax(-1) == float_logits.argmax(-1)).double().mean().item()
        rows.append(
            {
                "model": name,
                "scheme": label,
                "linear_weight_bytes": weight_bytes,
                "bytes_ratio": weight_bytes / float_bytes,
                "layers_quantized": sum(1 for d in log if d.outcome == "quantized"),
                "layers_skipped": len(skips),
                "rmse_fp64": _rmse(logits, reference),
                "rmse_float": _rmse(logits, float_logits),
                "relative_rmse_float": _rmse(logits, float_logits) / float_rms,
                "top1_agreement": agreement,
                "skipped": skips,
            }
        )
    return rows, skipped


def _rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).pow(2).mean().sqrt().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(DECODERS),
        help="comma-separated decoders from the zoo (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        default=None,
        choices=("tiny", "small", "full"),
        help="the zoo's tiny or full models, or small (this benchmark's: every input feature "
        "count a multiple of 128) (default: full on a GPU, small on a CPU, tiny with --check)",
    )
    parser.add_argument(
        "--batch", type=int, default=2, help="sequences per call (default: %(default)s)"
    )
    parser.add_argument(
        "--seq",
        type=int,
        default=None,
        help="tokens per sequence (default: "
        + ", ".join(f"{n} {size}" for size, n in SEQ.items())
        + ")",
    )
    parser.add_argument(
        "--quantize-head",
        action="store_true",
        help="quantize the output head too (option quantize_head=True; by default it stays "
        "in floating point)",
    )
    parser.add_argument(
        "--json", default=None, help="also write the results to this JSON file (default: none)"
    )
    parser.add_argument(
        "--check", action="store_true", help="the quick CPU check the test suite runs: tiny models"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("tiny" if args.check else "small" if device.type == "cpu" else "full")
    seq = args.seq or SEQ[size]
    models = args.models.split(",")
    available = [s for s, _ in SCHEMES if unavailable(s, device) is None]
    progress = Progress(len(models) * len(available))
    results, skipped = [], []
    for name in models:
        rows, skips = measure_model(
            name, size, args.batch, seq, args.quantize_head, device, progress
        )
        results += rows
        skipped += skips
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "benchmarks.quant", *(argv or sys.argv[1:])]),
        "size": size,
        "batch": args.batch,
        "seq": seq,
        "quantize_head": args.quantize_head,
        "results": results,
        "skipped": skipped,
    }
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def format_table(report: dict[str, Any]) -> str:
    head = "quantized" if report["quantize_head"] else "kept in floating point"
    lines = [
        f"weight quantization ({report['size']}, batch {report['batch']} x {report['seq']} "
        f"tokens) on {report['device']}; output head {head}",
        f"{'model':<6} {'scheme':<21} {'weight bytes':>12} {'ratio':>6} {'layers q/skip':>13} "
        f"{'RMSE fp64':>10} {'RMSE float':>10} {'relative':>9} {'top-1 agree':>11}",
    ]
    for r in report["results"]:
        layers = f"{r['layers_quantized']}/{r['layers_skipped']}"
        lines.append(
            f"{r['model']:<6} {r['scheme']:<21} {r['linear_weight_bytes']:>12} "
            f"{r['bytes_ratio']:>6.3f} {layers:>13} {r['rmse_fp64']:>10.2e} "
            f"{r['rmse_float']:>10.2e} {r['relative_rmse_float']:>9.2e} "
            f"{r['top1_agreement']:>11.3f}"
        )
    lines += [f"{s['model']:<6} {s['scheme']:<21} {s['reason']}" for s in report["skipped"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
