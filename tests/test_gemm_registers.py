"""A GEMM template's registers as the cost model counts them
(``gemm.template_registers``, ``gemm.epilogue_registers``) against sm_90
compiles: the count decides how many programs share an SM, so how many
waves the template's K loops take (``GemmConfig.k_loop``).  A 128 x 128
tile of 8 warps holds two programs an SM at 128 registers a thread, one
above; GELU's epilogue took 159 (erf form) and 202 (tanh form), which
the flat 128 counted as two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.lowering import lower_with_constants, optimize
from tilec import cost
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.gemm import (
    DOT,
    TEMPLATE_REGISTERS,
    Epilogue,
    GemmConfig,
    epilogue_of,
    epilogue_registers,
    template_config,
    template_registers,
)
from tilec.options import Options
from tilec.target import H100_SXM

OPTIONS = Options.from_user(None, {"freeze": True, "matmul": "triton"})
WIDE = GemmConfig(128, 128, 64, 8)  # 64 elements of the tile a thread


def _bias(w, b, x):
    return x @ w.t() + b


def _relu(w, b, x):
    return torch.relu(x @ w.t() + b)


def _gelu(w, b, x):
    return F.gelu(x @ w.t() + b)


def _gelu_tanh(w, b, x):
    return F.gelu(x @ w.t() + b, approximate="tanh")


def _silu_times(w, b, x):
    y = x @ w.t() + b
    return F.silu(y) * y


def _two_stores(w, b, x):
    y = x @ w.t() + b
    return y, torch.relu(y)


def _erfc(w, b, x):
    return torch.erfc(x @ w.t() + b)


def _sinh(w, b, x):
    return torch.sinh(x @ w.t() + b)


def _pow(w, b, x):
    return (x @ w.t() + b).abs() ** 1.7


def _template(fn):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 768, generator=g).to(torch.bfloat16)
    b = torch.randn(3072, generator=g).to(torch.bfloat16)
    x = torch.randn(4096, 768, generator=g).to(torch.bfloat16)
    graph = optimize(lower_with_constants(fn, (w, b), x), OPTIONS, gpu=True)
    (group,) = [g for g in graph.groups if any(graph.nodes[n].reduce_op == DOT for n in g.nodes)]
    (dot,) = [graph.nodes[n] for n in group.nodes if graph.nodes[n].reduce_op == DOT]
    return graph, group, dot


def test_the_epilogue_names_its_stores_and_ops():
    graph, group, dot = _template(_two_stores)
    epilogue = epilogue_of(graph, group.nodes, group.stored, dot)
    assert epilogue.stores == 2
    graph, group, dot = _template(_gelu)
    epilogue = epilogue_of(graph, group.nodes, group.stored, dot)
    assert (epilogue.stores, epilogue.values) == (1, 3)
    assert "erf" in epilogue.ops


def test_registers_grow_with_what_the_epilogue_does():
    cheap = Epilogue(values=3, stores=1, ops=frozenset({"add", "mul", "sigmoid"}))
    assert epilogue_registers(WIDE, cheap) == 100  # 64 elements + 36
    assert template_registers(WIDE, epilogue=cheap) == TEMPLATE_REGISTERS  # never below
    assert template_registers(WIDE) == TEMPLATE_REGISTERS  # the epilogue unknown
    gelu = Epilogue(values=3, stores=1, ops=frozenset({"add", "mul", "erf"}))
    assert epilogue_registers(WIDE, gelu) == 164  # one element more: x live across erf
    two = Epilogue(values=2, stores=2, ops=frozenset({"maximum"}))
    assert epilogue_registers(WIDE, two) == 132
    slow = Epilogue(values=2, stores=1, ops=frozenset({"erfc"}))
    assert epilogue_registers(WIDE, slow) == 228
    # Half the elements a thread, half the epilogue's registers.
    backward = Epilogue(values=6, stores=1, ops=frozenset({"tanh", "mul", "sub"}))
    narrow = GemmConfig(128, 64, 64, 8)
    assert epilogue_registers(narrow, backward) == 32 * (1 + 4) + 36  # gpt2's: 179
    assert epilogue_registers(WIDE, backward) == 255  # the most a thread may take
    # Packed weights keep their own calibration.
    assert template_registers(GemmConfig(16, 64, 512, 8), 2, gelu) == 255


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, over",
    [
        (_bias, False),
        (_relu, False),
        (_silu_times, False),
        (_gelu, True),
        (_gelu_tanh, None),  # 128 on triton 3.7.1: counted 228, one program
        (_two_stores, None),
        (_erfc, True),  # narrowed to 128 x 64 (``EPILOGUE_SCRATCH``): 139
        (_sinh, None),  # narrowed alike: 90, counted 132
        (_pow, True),  # in float64 (``_pow``): 238 at 128 x 128, counted 228
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_the_counted_programs_an_sm_are_no_more_than_the_compile_holds(
    fn, over, tmp_path, monkeypatch
):
    """Each template as codegen writes it, compiled for sm_90: it spills
    nothing, the programs an SM holds by the counted registers are at most
    those its compile holds (never a wave too few), and where the compile
    takes more than 128 registers (``over``), the count does too."""
    from benchmarks.sm90 import compile_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cache hit skips ptxas
    graph, group, dot = _template(fn)
    template = template_config(graph, group, dot, H100_SXM)
    kernel = write_kernel(graph, group, H100_SXM)
    compiled = compile_kernel(kernel_entry(graph, group, kernel, H100_SXM))
    assert compiled["ok"] and "registers" in compiled, compiled.get("error")
    assert not compiled.get("spill_bytes"), (template.config, compiled)
    warps = template.config.num_warps
    held = cost.resident_programs(H100_SXM, compiled["shared"], warps, compiled["registers"])
    assert kernel.program_loop == template.loop
    assert template.loop.resident <= held, (template, compiled["registers"])
    epilogue = epilogue_of(graph, group.nodes, group.stored, dot)
    counted = template_registers(template.config, template.pack, epilogue)
    if over is not None:
        assert (compiled["registers"] > TEMPLATE_REGISTERS) == over, compiled["registers"]
        assert (counted > TEMPLATE_REGISTERS) == over, counted
