"""The one model of the device (``compiler/target.py``): constructors, fields,
capabilities, and that no other source file asks torch about the device or
writes a hardware number the target holds."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tilec import target as target_module
from tilec.codegen.launch import blocks
from tilec.lower_ops import RULES
from tilec.pipeline import _rules_for
from tilec.target import (
    GPU_ATOMICS,
    H100_SXM,
    INTERPRETER,
    INTERPRETER_ATOMICS,
    UNREPORTED_SHARED_MEMORY,
    Figure,
    Target,
    from_properties,
)

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("compiler", "passes", "codegen", "runtime", "benchmarks")


def test_for_a_cpu_device_it_is_the_interpreter():
    target = Target.for_device(torch.device("cpu"))
    assert target == dataclasses.replace(INTERPRETER, tf32=target.tf32)
    assert target.interpret and target.capability is None
    assert not (target.bf16_dot or target.fp8_dot or target.libdevice)
    assert ("sum", torch.bfloat16) not in target.atomics  # the interpreter's own
    assert target.atomics == GPU_ATOMICS - {("sum", torch.bfloat16)}


def test_h100_sxm_fields():
    h100 = Target.named("h100-sxm")
    assert h100 == H100_SXM and not h100.interpret and h100.name == "H100 SXM"
    assert h100.capability == (9, 0) and h100.sm_count == 132 and h100.warp_size == 32
    assert h100.shared_memory_per_sm == 228 * 1024
    assert h100.shared_memory_per_block == 232448  # 227 KiB, the opt-in maximum
    assert (h100.registers_per_sm, h100.registers_per_thread) == (65536, 255)
    assert h100.max_warps_per_sm == 64
    assert h100.bf16_dot and h100.fp8_dot and h100.libdevice and not h100.tf32
    assert h100.atomics == GPU_ATOMICS
    # The roofline's figures, each with where it comes from.
    assert h100.memory_bandwidth.value == 3.0e12 and h100.memory_bandwidth.basis == "measured"
    assert h100.memory_bandwidth_peak.value == 3.35e12
    assert h100.memory_bandwidth_peak.basis == "datasheet"
    assert h100.peak_flops(torch.bfloat16).value == 800e12
    assert h100.peak_flops(torch.float32).value == 67e12  # no TF32: CUDA cores
    assert (
        h100.peak_flops(torch.float32).value
        < Target.named("h100-sxm", tf32=True).peak_flops(torch.float32).value
    )
    template = h100.peak_flops(torch.bfloat16, template=True)
    assert template.value == pytest.approx(0.85 * 800e12) and template.basis == "assumed"
    assert h100.launch_s.value == 2.5e-6 and h100.replay_s.value < h100.launch_s.value
    for name in target_module.FIGURES:
        value = getattr(h100, name)
        figures = [f for _, f in value] if isinstance(value, tuple) else [value]
        assert figures and all(isinstance(f, Figure) and f.source for f in figures), name
    assert Target.named("h200").capability == (9, 0)
    with pytest.raises(ValueError, match="unknown target 'a100'; known: h100-sxm, h200"):
        Target.named("a100")


def test_the_interpreter_has_no_performance_figures():
    with pytest.raises(ValueError, match="no library FLOP/s figure for torch.bfloat16"):
        INTERPRETER.peak_flops(torch.bfloat16)
    with pytest.raises(ValueError, match="no template FLOP/s figure for torch.int8"):
        H100_SXM.peak_flops(torch.int8, template=True)


@pytest.mark.parametrize(
    "capability, fp8",
    [((7, 5), False), ((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)],
)
def test_fp8_dot_needs_compute_capability_8_9(capability, fp8):
    assert dataclasses.replace(H100_SXM, capability=capability).fp8_dot is fp8


def _properties(**overrides):
    """What ``torch.cuda.get_device_properties`` gives (the fields tilec reads)."""
    props = dict(
        name="NVIDIA H100 80GB HBM3",
        major=9,
        minor=0,
        multi_processor_count=132,
        max_threads_per_multi_processor=2048,
        max_threads_per_block=1024,
        regs_per_multiprocessor=65536,
        warp_size=32,
        shared_memory_per_multiprocessor=233472,
        shared_memory_per_block_optin=232448,
    )
    return SimpleNamespace(**{**props, **overrides})


def test_a_cuda_device_from_its_properties():
    h100 = from_properties(_properties(), tf32=True)
    # Its properties and a known model's figures: the named target, but for the name.
    assert h100 == dataclasses.replace(
        H100_SXM, name="NVIDIA H100 80GB HBM3", tf32=True, limits_source=h100.limits_source
    )
    # A card that is no known model: its properties, no figures.
    ampere = _properties(
        name="NVIDIA A10",
        major=8,
        minor=6,
        multi_processor_count=72,
        shared_memory_per_multiprocessor=None,
        shared_memory_per_block_optin=None,
    )
    a10 = from_properties(ampere, tf32=False)
    assert (a10.name, a10.capability, a10.sm_count) == ("NVIDIA A10", (8, 6), 72)
    assert not a10.fp8_dot and a10.bf16_dot
    # Shared memory the properties do not give: the capability's table.
    assert (a10.shared_memory_per_sm, a10.shared_memory_per_block) == (100 * 1024, 99 * 1024)
    assert a10.memory_bandwidth is None and a10.library_flops == ()
    unknown = SimpleNamespace(**{**vars(ampere), "major": 11, "minor": 0})
    assert from_properties(unknown, tf32=False).shared_memory_per_block == UNREPORTED_SHARED_MEMORY


def test_blocks_follow_the_target():
    """The interpreter's blocks are large, a GPU's sized for occupancy."""
    assert blocks(INTERPRETER, 1 << 20, None) == (16384, 1, 8)
    assert blocks(H100_SXM, 1 << 20, None) == (1024, 1, 8)
    assert blocks(H100_SXM, 1 << 20, None, itemsize=2) == (1024, 1, 4)
    # A small kernel is spread over the SMs, down to one warp of 128-bit accesses.
    assert blocks(H100_SXM, 4096, None, itemsize=2) == (256, 1, 1)  # 16 programs
    assert blocks(H100_SXM, 32768, None) == (256, 1, 2)  # 128 programs of 4 fp32 a thread
    assert blocks(H100_SXM, 100, None) == (128, 1, 1)
    assert blocks(INTERPRETER, 4096, None) == (4096, 1, 8)
    assert blocks(INTERPRETER, 64, 10000) == (4, 4096, 8)
    # Reductions too: a program per row where there are fewer rows than SMs,
    # a tile of at least one warp's 128-bit accesses otherwise.
    assert blocks(H100_SXM, 64, 10000) == (1, 2048, 8)  # looped rows: 2048-element chunks
    assert blocks(H100_SXM, 64, 100) == (1, 128, 1)
    assert blocks(H100_SXM, 2048, 4) == (32, 4, 1)  # a split-KV combine: 64 programs
    assert blocks(H100_SXM, 1 << 16, 100) == (32, 128, 8)  # persistent rows: 4096 elements
    assert blocks(INTERPRETER, 2048, 4) == (2048, 4, 8)


def test_lowering_follows_the_capabilities():
    """Ops that need libdevice are lowered only where it exists; scatters that
    combine get the target's atomics."""
    aten = torch.ops.aten
    assert aten.atan in _rules_for(H100_SXM) and aten.atan not in _rules_for(INTERPRETER)
    assert _rules_for(INTERPRETER)[aten.index_put].keywords["atomics"] == INTERPRETER_ATOMICS
    assert _rules_for(H100_SXM)[aten.index_put].keywords["atomics"] == GPU_ATOMICS
    assert set(_rules_for(H100_SXM)) == set(RULES)


# The literals of hardware facts and capability checks that only compiler/target.py may write.
FORBIDDEN = {
    "Target(interpret=": re.compile(r"Target\(interpret="),
    "232448": re.compile(r"\b232448\b"),
    "228 * 1024": re.compile(r"\b228\s*\*\s*1024\b"),
    "allow_tf32 of CUDA matmuls": re.compile(r"matmul\.allow_tf32|matmul\.fp32_precision"),
    "get_device_capability": re.compile(r"get_device_capability"),
}


def lines_matching(patterns: dict[str, re.Pattern], allowed: Path) -> list[str]:
    """``path:line: what: text`` for each source line outside ``allowed``
    (in SOURCE_FOLDERS) that one of ``patterns`` matches."""
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == allowed:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                found += [
                    f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}"
                    for what, pattern in patterns.items()
                    if pattern.search(line)
                ]
    return found


def test_no_hardware_facts_outside_the_target():
    """Nothing but compiler/target.py reads the device's capability or TF32
    setting, builds a Target from a literal, or writes an H100 shared-memory size."""
    assert (ROOT / "compiler" / "target.py").is_file()
    found = lines_matching(FORBIDDEN, ROOT / "compiler" / "target.py")
    assert not found, "\n".join(found)


def test_the_check_finds_what_it_looks_for():
    lines = [
        "gpu = Target(interpret=False)",
        "SM90 = 232448",
        "per_sm = 228 * 1024",
        "tf32 = torch.backends.cuda.matmul.allow_tf32",
        "cc = torch.cuda.get_device_capability(device)",
    ]
    for line, pattern in zip(lines, FORBIDDEN.values()):
        assert pattern.search(line), line
