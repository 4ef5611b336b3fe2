"""Weight quantization (``options={"quantize": ...}``): options, names, the pass.

Quantized programs are compared twice: tightly against eager computed on the
dequantized weights the program holds (rebuilt here with torch from the
same integer values and scales: the program must compute exactly that), and
loosely against the float model (the quantization error itself).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tilec
from benchmarks.sm90 import compile_kernel
from benchmarks.zoo import MODELS
from tests.compare import assert_matches_eager
from tests.lowering import lower_with_constants, new_programs, optimize
from tilec import gemm as gemm_rules
from tilec import index as ix
from tilec.anchors import anchor_of
from tilec.codegen import gemm
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.decisions import Decision, of_stage
from tilec.freeze import parameter_name
from tilec.gemm import GEMM
from tilec.interpret import interpret
from tilec.ir import Graph, Load, walk
from tilec.options import Options, check_target
from tilec.passes.quantize import linear_weight_bytes, quantize
from tilec.target import H100_SXM, INTERPRETER


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"quantize": "int8_weight_only"}, ValueError, "needs options=.'freeze': True."),
        ({"quantize": "int3", "freeze": True}, ValueError, "one of .*int8_weight_only.*fp8"),
        (
            {"quantize": "int4_weight_only", "freeze": True, "quantize_group_size": 48},
            ValueError,
            r"one of \(32, 64, 128\)",
        ),
        ({"quantize_skip": "lm_head.weight"}, TypeError, "list of fnmatch patterns"),
        ({"quantize_head": 1}, TypeError, "'quantize_head' must be a bool"),
    ],
)
def test_quantize_options_are_checked_with_clear_errors(options, error, match) -> None:
    with pytest.raises(error, match=match):
        Options.from_user(None, options)


def test_quantize_options_defaults() -> None:
    opts = Options.from_user(None, {"quantize": "int4_weight_only", "freeze": True})
    assert (opts.quantize_group_size, opts.quantize_skip, opts.quantize_head) == (128, (), False)
    assert Options.from_user(None, None).quantize is None


def test_fp8_needs_an_fp8_gpu_at_compile_time() -> None:
    opts = Options.from_user(None, {"quantize": "fp8", "freeze": True})
    with pytest.raises(
        ValueError, match="fp8.*compute capability 8.9 or newer.*runs on the Triton interpreter"
    ):
        check_target(opts, INTERPRETER)
    check_target(
        Options.from_user(None, {"quantize": "int8_weight_only", "freeze": True}), INTERPRETER
    )
    check_target(opts, H100_SXM)
    ampere = dataclasses.replace(H100_SXM, name="A10", capability=(8, 6))
    with pytest.raises(ValueError, match=r"runs on the A10 \(compute capability 8.6\)"):
        check_target(opts, ampere)
    compiled = torch.compile(
        nn.Linear(4, 3), backend="tilec", options={"quantize": "fp8", "freeze": True}
    )
    with torch.no_grad(), pytest.raises(Exception, match="compute capability 8.9"):
        compiled(torch.randn(2, 4))


def test_parameter_names_from_dynamo_sources() -> None:
    source = "L['self']._modules['model']._modules['layers']._modules['0']._parameters['weight']"
    assert parameter_name(source) == "model.layers.0.weight"
    assert parameter_name("L['self']._buffers['inv_freq']") == "inv_freq"


def test_frozen_constants_keep_their_parameter_names() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    before = set(tilec.programs())
    assert_matches_eager(model, torch.randn(2, 4), options={"freeze": True})
    (program,) = new_programs(before)
    names = sorted(program.graph.constant_names.values())
    assert names == ["0.bias", "0.weight", "2.bias", "2.weight"]


# ------------------------------------------------------------ the rewrite

INT8 = ("int8_weight_only", 128)
SCHEMES = [INT8, *(("int4_weight_only", g) for g in (32, 64, 128))]


def _reference_quantize(weight: torch.Tensor, scheme: str, group: int) -> tuple[torch.Tensor, ...]:
    """The documented schemes, written again with torch: (stored values, scales)
    of a weight [N, K].  int4 stores q + 8, low nibble = even k."""
    w = weight.double()
    if scheme == "int8_weight_only":
        scale = (w.abs().amax(1) / 127).float()
        scale[scale == 0] = 1
        return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
    rows, cols = w.shape
    groups = weight.reshape(rows, cols // group, group)
    scale = groups.abs().amax(2) / 7.5
    scale[scale == 0] = 1
    q = torch.round(groups / scale[..., None]).clamp(-8, 7).reshape(rows, cols).to(torch.uint8) + 8
    return q[:, 0::2] | (q[:, 1::2] << 4), scale


def _reference_dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantized [N, K] float32 weight, computed as the program must."""
    if stored.dtype == torch.int8:
        return stored.float() * scale[:, None]
    nibbles = torch.stack([stored & 15, stored >> 4], -1).reshape(stored.shape[0], -1)
    group = nibbles.shape[1] // scale.shape[1]
    return (nibbles.to(torch.int32) - 8).float() * scale.repeat_interleave(group, 1)


def _program_weights(graph: Graph, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Parameter name -> the weight the program computes from its quantized
    constants, in the parameter's layout, rebuilt here with torch.  Weights
    merged into one matmul (``passes/merge_matmuls.py``, named ``a+b``) are
    split by the rows of ``model``'s parameters."""
    weights = {}
    for node in graph.nodes.values():
        stored = [i for i in node.inputs if graph.nodes[i].dtype in (torch.int8, torch.uint8)]
        if node.kind != "pointwise" or len(stored) != 1 or len(node.inputs) != 2:
            continue
        stored, scale = (graph.constants[i] for i in node.inputs)
        weight = _reference_dequantize(stored, scale)
        load = next(e for e in walk(node.body) if isinstance(e, Load) and e.src == 0)
        transposed = load.index[0] != ix.out_symbols(2)[0]  # x @ W: W is [K, N]
        weight = weight.t() if transposed else weight
        names = graph.constant_names[node.inputs[0]].split("+")
        rows = [model.get_parameter(n).shape[0] for n in names] if len(names) > 1 else [len(weight)]
        weights.update(zip(names, weight.split(rows), strict=True))
    return weights


def _compile(model: nn.Module, x: torch.Tensor, **options) -> tuple[torch.Tensor, Graph]:
    """The output of ``model`` frozen and compiled with ``options``, and its program's graph."""
    before = set(tilec.programs())
    compiled = torch.compile(model, backend="tilec", options={"freeze": True, **options})
    with torch.no_grad():
        out = compiled(x)
    (program,) = new_programs(before)
    return out, program.graph


def _with_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    reference = copy.deepcopy(model)
    for name, weight in weights.items():
        reference.get_parameter(name).data.copy_(weight)
    return reference


def _skipped(graph: Graph) -> dict[str, Decision]:
    """The layers the quantization pass kept in floating point, by parameter name."""
    return {
        d.subject.split()[0]: d
        for d in of_stage(graph.decisions, "quantize")
        if d.outcome == "skipped"
    }


def _relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def _mlp() -> nn.Module:
    """Input features 128, 64 and 63 (odd): int4 quantizes the first layer at
    every group size, the second at 32 and 64, never the third."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 63), nn.GELU(), nn.Linear(63, 5)
    ).eval()


# Output error of the quantized MLP relative to the float one (RMS over RMS);
# measured 0.007 (int8) and 0.07-0.09 (int4) on these random weights.
LOOSE = {"int8_weight_only": 0.02, "int4_weight_only": 0.15}


@pytest.mark.parametrize("scheme, group", SCHEMES, ids=lambda v: str(v))
def test_quantized_mlp_computes_exactly_its_dequantized_weights(scheme: str, group: int) -> None:
    model, x = _mlp(), torch.randn(6, 128)
    options = {"quantize": scheme, "quantize_group_size": group, "quantize_head": True}
    out, graph = _compile(model, x, **options)
    weights = _program_weights(graph)
    expected_layers = {
        "int8_weight_only": {"0.weight", "2.weight", "4.weight"},
        "int4_weight_only": {"0.weight", "2.weight"} if group < 128 else {"0.weight"},
    }[scheme]
    assert set(weights) == expected_layers
    for name in weights:
        stored, scale = _reference_quantize(model.get_parameter(name).detach(), scheme, group)
        program_stored, program_scale = (
            graph.constants[n] for n in graph.constants if graph.constant_names.get(n) == name
        )
        assert torch.equal(program_stored, stored) and torch.equal(program_scale, scale.float())
    with torch.no_grad():
        expected = _with_weights(model, weights)(x)
        float_out = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert 0 < _relative_rms(out, float_out) < LOOSE[scheme]
    kept = _skipped(graph)
    assert len(kept) == 3 - len(expected_layers)
    assert all(d.reason == "scheme_refuses" for d in kept.values())
    assert all("not a multiple of the group size" in d.detail for d in kept.values())


def test_the_output_head_stays_float_unless_asked_and_patterns_skip_layers() -> None:
    model, x = _mlp(), torch.randn(6, 128)
    _, graph = _compile(model, x, quantize="int8_weight_only", quantize_skip=["2.*"])
    assert set(_program_weights(graph)) == {"0.weight"}
    kept = _skipped(graph)
    assert (kept["4.weight"].reason, kept["2.weight"].reason) == ("output_head", "skip_pattern")
    assert "quantize_skip pattern '2.*'" in kept["2.weight"].detail
    floats = {graph.constant_names.get(n): t for n, t in graph.constants.items()}
    for name in ("2.weight", "4.weight"):
        assert torch.equal(floats[name], model.get_parameter(name).detach())


class TiedHead(nn.Module):
    """An embedding whose table is also the output head's weight (GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = nn.Embedding(32, 16), nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.mix(self.embed(ids))) @ self.embed.weight.t()


def test_a_weight_something_else_reads_stays_float() -> None:
    torch.manual_seed(0)
    model, ids = TiedHead().eval(), torch.randint(0, 32, (2, 5))
    out, graph = _compile(model, ids, quantize="int8_weight_only", quantize_head=True)
    assert set(_program_weights(graph)) == {"mix.weight"}
    ((name, kept),) = _skipped(graph).items()
    assert name == "embed.weight" and kept.reason == "other_readers"
    assert "also read by %embedding" in kept.detail
    with torch.no_grad():
        torch.testing.assert_close(out, _with_weights(model, _program_weights(graph))(ids))


class TransposedWeight(nn.Module):
    """``x @ W`` with ``W`` stored [K, N] (GPT-2's Conv1D)."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) / k**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


@pytest.mark.parametrize("scheme, group", [INT8, ("int4_weight_only", 32)], ids=str)
def test_a_weight_stored_input_major_is_quantized_per_output_channel(scheme, group) -> None:
    torch.manual_seed(0)
    model, x = TransposedWeight(64, 24).eval(), torch.randn(3, 64)
    options = {"quantize": scheme, "quantize_group_size": group, "quantize_head": True}
    out, graph = _compile(model, x, **options)
    (stored,) = [t for t in graph.constants.values() if t.dtype in (torch.int8, torch.uint8)]
    assert stored.shape[0] == 24  # one row per output channel
    expected, _ = _reference_quantize(model.weight.detach().t(), scheme, group)
    assert torch.equal(stored, expected)
    with torch.no_grad():
        torch.testing.assert_close(out, _with_weights(model, _program_weights(graph))(x))


def test_a_batched_matmul_reading_a_constant_weight_is_quantized() -> None:
    def fn(w, x):
        return torch.bmm(x, w.t().unsqueeze(0).expand(x.shape[0], -1, -1)).relu() @ w

    w, x = torch.randn(12, 32), torch.randn(2, 5, 32)
    graph = lower_with_constants(fn, (w,), x)
    after, counts = quantize(graph, "int8_weight_only", head=True)
    # bmm reads w transposed, mm as stored: two orientations, one constant.
    assert counts["quantized"] == 0 and after.decisions[0].reason == "both_orientations"

    def bmm_only(w, x):
        return torch.bmm(x, w.t().unsqueeze(0).expand(x.shape[0], -1, -1))

    graph = lower_with_constants(bmm_only, (w,), x)
    after, counts = quantize(graph, "int8_weight_only", head=True)
    assert counts == {
        "quantized": 1,
        "skipped": 0,
        "constant_bytes_before": 12 * 32 * 4,
        "constant_bytes_after": 12 * 32 + 12 * 4,
    }
    assert "random input" in after.decisions[0].detail
    stored, scale = _reference_quantize(w, "int8_weight_only", 0)
    expected = bmm_only(_reference_dequantize(stored, scale), x)
    torch.testing.assert_close(interpret(after, [x])[0], expected, rtol=1e-6, atol=1e-6)


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Logits error of the quantized tiny LLaMA relative to the float one.
LLAMA_LOOSE = {"int8_weight_only": 0.02, "int4_weight_only": 0.15}


@pytest.mark.parametrize(
    "scheme, group, head", [(*INT8, True), ("int4_weight_only", 32, False)], ids=str
)
def test_quantized_tiny_llama(scheme: str, group: int, head: bool) -> None:
    torch.manual_seed(0)
    spec = MODELS["llama"]
    model = spec.build("tiny").model.eval()
    (ids,) = spec.inputs("tiny", 1, torch.Generator().manual_seed(0))
    options = {"quantize": scheme, "quantize_group_size": group, "quantize_head": head}
    out, graph = _compile(model, ids, **options)
    weights = _program_weights(graph, model)
    layers = {f"model.model.layers.{k}.{p}.weight" for k in (0, 1) for p in PROJECTIONS}
    kept = _skipped(graph)
    if head:
        assert set(weights) == layers | {"model.lm_head.weight"} and not kept
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        float_bytes = sum(m.weight.numel() * 4 for m in linears)
        # int8: one byte per weight, plus the scales: a quarter and a bit.
        assert 0.25 * float_bytes < linear_weight_bytes(graph) <= 0.3 * float_bytes
    else:  # down_proj has 176 input features: not a multiple of 32
        assert set(weights) == {n for n in layers if "down_proj" not in n}
        assert kept["model.lm_head.weight"].reason == "output_head"
        assert all("not a multiple" in kept[n].detail for n in layers - set(weights))
    with torch.no_grad():
        expected = _with_weights(model, weights)(ids)
        float_logits = model(ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert 0 < _relative_rms(out, float_logits) < LLAMA_LOOSE[scheme]
    # Every dequantization is a GEMM's prologue: no kernel writes a float weight.
    quantized = {n for n, t in graph.constants.items() if t.dtype in (torch.int8, torch.uint8)}
    dequants = {n.name for n in graph.nodes.values() if set(n.inputs) & quantized}
    # One per weight, or per weights merged into one matmul (q+k+v, gate+up).
    assert len(dequants) == len({graph.constant_names[n] for n in quantized})
    values = [graph.nodes[d].inputs[0] for d in dequants]  # each one's stored values
    assert sum(len(graph.constant_names[v].split("+")) for v in values) == len(weights)
    for group in graph.groups:
        assert not set(group.stored) & dequants, group
        if set(group.nodes) & dequants:
            assert any(anchor_of(graph.nodes[m]) is GEMM for m in group.nodes), group
    assert dequants <= {m for group in graph.groups for m in group.nodes}
    # RMS norms' statistics computed in a GEMM's prologue: the MLP norms
    # (gate/up); the second layer's input norm (q/k/v) where the first
    # layer's down projection is a template whose epilogue stores the
    # residual (with int4 it stays float, a library call, and the norm's
    # kernel adds and stores the residual); the final norm where the head
    # is quantized.  Never the first input norm: its kernel stores the
    # embedding.
    prologue_norms = [
        m
        for group in graph.groups
        if any(anchor_of(graph.nodes[n]) is GEMM for n in group.nodes)
        for m in group.nodes
        if graph.nodes[m].kind == "reduction" and anchor_of(graph.nodes[m]) is None
    ]
    assert len(prologue_norms) == (4 if head else 2), prologue_norms


def test_the_interpreter_runs_the_quantized_program_as_the_kernels_do() -> None:
    model, x = _mlp(), torch.randn(6, 128)
    options = {"freeze": True, "quantize": "int4_weight_only", "quantize_group_size": 32}
    outputs = []
    for interpret_ir in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(
            model, backend="tilec", options={**options, "interpret": interpret_ir}
        )
        with torch.no_grad():
            outputs.append(compiled(x))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert _relative_rms(outputs[0], model(x)) > 1e-3  # quantized, not the float model


def test_the_pass_is_dumped_and_reported(tmp_path: Path) -> None:
    model, x = _mlp(), torch.randn(6, 128)
    _compile(model, x, quantize="int8_weight_only", dump=str(tmp_path))
    (dump,) = tmp_path.glob("*/*-quantize.txt")
    text = dump.read_text()
    assert "%_tilec_frozen_0_int8 = constant  i8[64, 128]  (0.weight)" in text
    assert "_dequant = pointwise f32[64, 128]  mul(f32(%" in text
    quantized = [line for line in text.splitlines() if line.endswith("[int8_weight_only]")]
    assert len(quantized) == 2 and all("compile-time example input" in q for q in quantized)
    assert "quantize: quantized 0.weight f32[64, 128]: 32768 -> 8448 bytes" in text
    summary = json.loads((dump.parent / "summary.json").read_text())
    (counts,) = [p for p in summary["passes"] if p["name"] == "quantize"]
    assert (counts["quantized"], counts["skipped"]) == (2, 1)
    assert counts["constant_bytes_after"] < counts["constant_bytes_before"]
    records = [d for d in summary["decisions"] if d["stage"] == "quantize"]
    assert [(d["outcome"], d["subject"].split()[0]) for d in records] == [
        ("quantized", "0.weight"),
        ("quantized", "2.weight"),
        ("skipped", "4.weight"),
    ]
    report = (dump.parent / "summary.txt").read_text()
    assert report.split("quantization:\n")[1].splitlines() == [
        f"  {line.split('quantize: ', 1)[1]}"
        for line in text.splitlines()
        if "  quantize: " in line
    ]


def test_a_graph_with_symbolic_sizes_is_quantized_and_measured_on_random_inputs() -> None:
    model = _mlp()
    options = {"freeze": True, "quantize": "int8_weight_only", "quantize_head": True}
    compiled = torch.compile(model, backend="tilec", options=options, dynamic=True)
    before = set(tilec.programs())
    with torch.no_grad():
        outputs = [(x, compiled(x)) for x in (torch.randn(5, 128), torch.randn(7, 128))]
    (program,) = new_programs(before)  # the generic variant
    graph = program.graph
    assert len(_program_weights(graph)) == 3
    quantized = of_stage(graph.decisions, "quantize")
    assert quantized and all("random input" in d.detail for d in quantized)
    reference = _with_weights(model, _program_weights(graph))
    with torch.no_grad():
        for x, out in outputs:
            torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int4_weight_only"])
@pytest.mark.parametrize("rows", [4, 256])  # decode-shaped (small-M tiles) and larger
def test_bf16_quantized_gemms_compile_for_sm90(scheme: str, rows: int) -> None:
    """bf16 GEMMs (the Triton interpreter has no bf16 dot) with the weight
    dequantized in the prologue compile for sm_90 without spills, and no
    kernel stores the dequantized weight."""

    def linear(w, x):
        return torch.nn.functional.linear(x, w).relu()

    w, x = torch.randn(512, 256).bfloat16(), torch.randn(rows, 256).bfloat16()
    graph, _ = quantize(lower_with_constants(linear, (w,), x), scheme, 64, head=True)
    # The template, whichever the cost model prefers at this size.
    graph = optimize(graph, Options(matmul="triton"), gpu=True)
    (group,) = graph.groups
    kernel = write_kernel(graph, group, H100_SXM)
    assert kernel.template == "gemm" and group.stored == (graph.outputs[0],)
    result = compile_kernel(kernel_entry(graph, group, kernel))
    assert result["ok"], result.get("error")
    assert not result.get("spill_bytes")


# Rows (1: small-M tiles, BLOCK_K 128, a step of 64 packed positions; 40:
# BLOCK_K 64, 32) and group size (in packed positions: half).
@pytest.mark.parametrize("rows, group", [(1, 128), (1, 64), (8, 128), (40, 64)], ids=str)
def test_int4_products_walk_k_as_nibble_slices_and_match_their_weights(
    rows: int, group: int
) -> None:
    """An int4 weight's product walks K as the two nibble slices of its
    packed bytes (``codegen/gemm.py``, ``packing``): each K step loads the
    bytes once, at the packed index, and multiplies the low nibbles with the
    even columns of the input and the high ones with the odd; the group
    scales once per step where a group spans whole steps (``Gemm.per_step``),
    else at every position.  fp16 here:
    the interpreter's ``tl.dot`` is right for fp16, not for bf16.  Oracle:
    the product with the program's dequantized weight in float64.  The input
    is computed over the step's contiguous positions and split into the
    even and odd ones in registers (``Gemm.deinterleave``).  At 8 rows the
    interpreter's tile is the H100's few-row int4 alternative's, 16 x 64 x
    256 (``gemm.packed_alternative``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64)).half().eval()
    x = torch.randn(rows, 256).half()
    before = set(tilec.programs())
    compiled = torch.compile(
        model,
        backend="tilec",
        options={
            "freeze": True,
            "quantize": "int4_weight_only",
            "quantize_group_size": group,
            "quantize_head": True,  # the model's only layer is its head
        },
    )
    with torch.no_grad():
        out = compiled(x)
    (program,) = new_programs(before)
    (step,) = [s for s in program.plan.launches() if s.kernel.template == "gemm"]
    source = step.kernel.source
    assert "ja = koff // 2 + tl.arange(0, BLOCK_K // 2)" in source
    # The input loaded over the step's contiguous positions, split in registers.
    assert "tl.split(tl.reshape(" in source
    constexprs = step.kernel.launch.constexprs
    if rows == 8:
        assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"]) == (
            16,
            64,
            256,
        )
    width, packed_group = constexprs["BLOCK_K"] // 2, group // 2
    if packed_group % width == 0:  # the scale read once per step, at its first position
        assert "rks0 = koff // 2" in source and f"(rks0 // {packed_group})" in source
    else:
        assert "rks0" not in source and f"(rjb0 // {packed_group})" in source
    weight = _program_weights(program.graph)["0.weight"]
    bias = model[0].bias.double()
    expected = nn.functional.linear(x.double(), weight.double(), bias)
    # fp16 output: within its rounding (2**-11 relative) and the accumulation's.
    torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("rows, narrow", [(1, False), (1, True), (256, False)])
def test_int4_weight_bytes_are_loaded_whole_on_sm90(rows: int, narrow: bool, monkeypatch) -> None:
    """On sm_90 a bf16 product with an int4 weight loads no global byte on
    its own: the packed bytes go in 8- or 16-byte copies (before the nibble
    slices, every byte was loaded once per nibble, one byte per load).  Its
    bytes and FLOPs (what the cost model prices) are those of the plain K
    walk: the slices and the scale read once per step count each position once.
    The K loop waits for no load (``loop_loads``): at one row, before
    ``SMALL_M_BLOCK_K``, each step waited for its 2-byte input loads.  At
    one row, both tiles of ``packed_small_m``: the cost model's choice (64
    columns of 512 positions) and the 16-column tile of 256 it weighs."""
    if narrow:
        monkeypatch.setattr(gemm_rules, "_fastest_packed", lambda *args: args[3])

    def linear(w, x):
        return torch.nn.functional.linear(x, w)

    # One row: K steps of 256 positions, enough of them to make a K loop, and
    # columns enough for the template to be predicted faster than the library.
    n, k = (2048, 2048) if rows == 1 else (512, 256)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    graph, _ = quantize(lower_with_constants(linear, (w,), x), "int4_weight_only", 128, head=True)
    graph = optimize(graph, gpu=True)
    (group,) = graph.groups
    kernel = write_kernel(graph, group, H100_SXM)
    entry = kernel_entry(graph, group, kernel)
    result = compile_kernel(entry)
    assert result["ok"], result.get("error")
    assert result["loads_8"] == 0
    assert result["copies"] > 0 and not result.get("spill_bytes")
    # Nothing the K loop waits for every step: the input too is copied ahead.
    assert result["loop_loads"] == 0
    assert result["shared"] <= H100_SXM.shared_memory_per_block
    if rows == 1:  # no spill either way (``packed_small_m``, ``_fastest_packed``)
        tile = (entry["constexprs"]["BLOCK_N"], entry["constexprs"]["BLOCK_K"], entry["num_stages"])
        assert tile == ((16, 256, 4) if narrow else (64, 512, 3))
    # A group of 128 is 64 packed positions: whole steps of 32 (BLOCK_K 64,
    # rows 256) read the scale once per step; steps of 256 (rows 1) per position.
    assert ("rks0 = koff // 2" in kernel.source) == (rows > 1)
    monkeypatch.setattr(gemm_rules, "packing", lambda *_: 1)
    monkeypatch.setattr(gemm.Gemm, "per_step", lambda self, value: value)
    plain = write_kernel(graph, group, H100_SXM)  # as before either
    assert "koff // 2" not in plain.source and "rks0" not in plain.source
    assert kernel.reads == plain.reads and kernel.bytes_written == plain.bytes_written
    assert 0.9 < kernel.flops / plain.flops < 1.1


def _int4_product_kernel(left, n: int, k: int, rows: int, monkeypatch, narrow: bool):
    """The H100 kernel of ``left(x, y) @ w.T`` with ``w`` an ``n x k`` int4
    weight and ``x``, ``y`` of ``rows`` rows; ``narrow``: with the 16-column
    tile :func:`gemm._fastest_packed` weighs against 64 columns."""
    if narrow:
        monkeypatch.setattr(gemm_rules, "_fastest_packed", lambda *args: args[3])

    def linear(w, x, y):
        return torch.nn.functional.linear(left(x, y), w)

    w = torch.randn(n, k).bfloat16()
    x, y = torch.randn(rows, k).bfloat16(), torch.randn(rows, k).bfloat16()
    graph, _ = quantize(
        lower_with_constants(linear, (w,), x, y), "int4_weight_only", 128, head=True
    )
    graph = optimize(graph, gpu=True)
    (group,) = [g for g in graph.groups if any(GEMM.owns(graph.nodes[m]) for m in g.nodes)]
    dot = next(graph.nodes[m] for m in group.nodes if GEMM.owns(graph.nodes[m]))
    left_computed = gemm_rules.computing(graph, dot.inputs[0], set(group.nodes))
    return graph, group, write_kernel(graph, group, H100_SXM), bool(left_computed)


def test_one_row_int4_tiles_are_the_faster_of_two(monkeypatch) -> None:
    """A one-row int4 product over a long K whose 64-column tiles do not
    fill the SMs (TinyLlama's down projection's size): 16 columns of 256
    positions take 22 K steps, 64 columns of 512 take 11 on a quarter of
    the programs.  The template takes the 64-column tile, and the kernel as
    written is predicted faster than the 16-column one (as the static
    report prices kernels: ``benchmarks.static.kernel_prediction``).  Both
    compile for sm_90 without a spill."""
    from benchmarks.static import kernel_prediction

    n, k = 2048, 5632
    kernels = {}
    for narrow in (False, True):
        graph, group, kernel, computed = _int4_product_kernel(
            lambda x, y: x, n, k, 1, monkeypatch, narrow
        )
        assert not computed
        kernels[narrow] = kernel
        result = compile_kernel(kernel_entry(graph, group, kernel))
        assert result["ok"] and not result.get("spill_bytes"), result
    wide, narrow = kernels[False], kernels[True]
    assert (wide.launch.constexprs["BLOCK_N"], wide.launch.constexprs["BLOCK_K"]) == (64, 512)
    assert (narrow.launch.constexprs["BLOCK_N"], narrow.launch.constexprs["BLOCK_K"]) == (16, 256)
    assert kernel_prediction(wide).seconds < kernel_prediction(narrow).seconds
    assert wide.bytes_read == narrow.bytes_read


def test_int4_tiles_stay_narrow_at_one_row_with_a_computed_left_operand(monkeypatch) -> None:
    """At one row with the left operand computed in the prologue
    (``silu(x) * y``, the down projection's), the 64 x 512 tile spilled on
    sm_90: the product keeps 16 columns of 256."""

    def fn(x, y):
        return torch.nn.functional.silu(x) * y

    _, _, kernel, computed = _int4_product_kernel(fn, 2048, 5632, 1, monkeypatch, narrow=False)
    assert computed
    assert (kernel.launch.constexprs["BLOCK_N"], kernel.launch.constexprs["BLOCK_K"]) == (16, 256)


@pytest.mark.parametrize("left", ["stored", "computed"])
def test_few_row_int4_tiles_are_64_columns_of_256_positions(left: str, monkeypatch) -> None:
    """At 8 rows a 64 x 512 tile took up to 255 registers on sm_90, but 64
    columns of 256 positions (8 warps, ``gemm.packed_alternative``) take
    at most ``PACKED_WIDE_SHORT_REGISTERS``, the figure the cost model
    counts programs an SM by, spill nothing and wait for no load in the K
    loop, the left operand computed in the prologue or not.  TinyLlama's
    down projection at 8 rows takes them, split over K (that they are
    predicted faster there: ``test_split_k``)."""
    computes = left == "computed"
    fn = (lambda x, y: torch.nn.functional.silu(x) * y) if computes else (lambda x, y: x)
    graph, group, kernel, computed = _int4_product_kernel(fn, 2048, 5632, 8, monkeypatch, False)
    assert computed == computes  # whether the prologue computes the left operand
    tile = (kernel.launch.constexprs["BLOCK_N"], kernel.launch.constexprs["BLOCK_K"])
    assert (*tile, kernel.launch.num_warps) == (64, 256, 8)
    result = compile_kernel(kernel_entry(graph, group, kernel))
    assert result["ok"] and not result.get("spill_bytes"), result
    assert result["loop_loads"] == 0
    assert result["registers"] <= gemm_rules.PACKED_WIDE_SHORT_REGISTERS
