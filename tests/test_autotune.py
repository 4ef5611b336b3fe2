"""max-autotune (``codegen/autotune.py``): candidates, selection, the disk
cache and its trust rules, library-or-template races, and the CPU message.

Without a GPU nothing is timed for real: the tests add a deterministic fake
timer for the CPU to ``autotune.TIMERS`` (the tuner's device check), so the
Triton interpreter runs what a GPU would benchmark, and the choice follows
the fake times.  Each test has its own cache folder.  The ``gpu`` test at
the end times for real.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

import tilec
from tests.lowering import aten_graph, lower, new_programs
from tilec.codegen import autotune
from tilec.codegen.autotune import Trial
from tilec.codegen.cache import ENV as CACHE_ENV
from tilec.codegen.gemm import TUNING_TILES, gemm_candidates, masks_k
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import kernel_entry
from tilec.gemm import SMALL_M, GemmConfig, gemm_config, gpu_gemm_config
from tilec.interpret import interpret
from tilec.lower import lower_graph
from tilec.lower_ops import RULES
from tilec.options import Options
from tilec.passes.matmul import _bare, choose_matmul
from tilec.target import H100_SXM, INTERPRETER

NOBODY = 65534
ROOT = os.geteuid() == 0
TUNE = {"autotune": True}


class FakeTimer:
    """Deterministic times: the trial ``fastest`` accepts takes 1 ms, the
    library call 1.5 ms, every other configuration 2 ms.  ``run``: launch
    each trial once (the interpreter runs the benchmark harness for real)."""

    def __init__(self, fastest: Callable[[Trial], bool], run: bool = False):
        self.fastest = fastest
        self.run = run
        self.trials: list[Trial] = []

    def __call__(self, trial: Trial) -> float:
        self.trials.append(trial)
        if self.run:
            trial.run()
        if self.fastest(trial):
            return 1.0
        return 1.5 if trial.config is None else 2.0


def library(trial: Trial) -> bool:
    return trial.config is None


def config_is(config: GemmConfig) -> Callable[[Trial], bool]:
    return lambda trial: trial.config == config


def any_config(trial: Trial) -> bool:
    return trial.config is not None


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture
def timer(monkeypatch) -> Callable[..., FakeTimer]:
    """Install a :class:`FakeTimer` for the CPU: ``timer(fastest, run=...)``."""

    def install(fastest: Callable[[Trial], bool], run: bool = False) -> FakeTimer:
        fake = FakeTimer(fastest, run)
        monkeypatch.setitem(autotune.TIMERS, "cpu", fake)
        return fake

    return install


def _compile(fn, *inputs, options=TUNE, dump: Path | None = None):
    """``fn`` compiled with tilec, checked against eager; the new programs' launches."""
    torch._dynamo.reset()
    before = set(tilec.programs())
    if dump is not None:
        options = {**options, "dump": str(dump)}
    compiled = torch.compile(fn, backend="tilec", options=options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=1e-4, rtol=1e-4)
    return [step for p in new_programs(before) for step in p.launches()]


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _gemm_configs(launches) -> list[GemmConfig]:
    return [GemmConfig.of(s.kernel.launch) for s in launches if s.kernel.template == "gemm"]


def _warnings(caplog, logger: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == logger
    ]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 72), torch.nn.GELU(), torch.nn.Linear(72, 24)
    ).eval()


# --- candidates ----------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


PROBLEMS = [
    (1, 4096, 4096, torch.bfloat16),  # decode
    (8, 11008, 4096, torch.float16),
    (4096, 4096, 4096, torch.float16),
    (512, 768, 3072, torch.float32),
    (100, 100, 96, torch.float32),  # the heuristic's BLOCK_K divides K
    (20, 40, 48, torch.float32),  # ragged K
    (16, 64, 40, torch.float16),
    (3, 5, 7, torch.float32),  # every side below 16
]


@pytest.mark.parametrize("m, n, k, dtype", PROBLEMS)
def test_every_candidate_is_valid(m, n, k, dtype):
    candidates = gemm_candidates(
        m, n, k, dtype, H100_SXM.shared_memory_per_block, H100_SXM.sm_count
    )
    heuristic = gpu_gemm_config(m, n, k, dtype, H100_SXM.sm_count)
    assert candidates[0] == heuristic
    # The target's choice of stages (``fewest_waves``) changes only those.
    chosen = gemm_config(H100_SXM, m, n, k, dtype)
    assert dataclasses.replace(chosen, num_stages=heuristic.num_stages) == heuristic
    assert chosen.num_stages in ((2, 3, 4, 6, 8) if m <= SMALL_M else (3, 4)), chosen
    assert len(set(candidates)) == len(candidates) <= len(TUNING_TILES) + 1
    for c in candidates:
        assert min(c.block_m, c.block_n, c.block_k) >= 16, c  # tl.dot's minimum
        # Few rows: fewer warps for shorter K steps, more stages on narrow tiles.
        assert c.num_warps in ((1, 2, 4, 8) if m <= SMALL_M else (4, 8)), c
        assert c.num_stages in ((3, 4, 6, 8) if m <= SMALL_M else (3, 4)), c
        # The source is written for the heuristic's BLOCK_K: without K masks,
        # every BLOCK_K must divide K.
        if not masks_k(k, heuristic.block_k):
            assert k % c.block_k == 0, c
    for c in candidates[1:]:
        assert c.block_m <= max(16, _pow2(m)) and c.block_n <= max(16, _pow2(n)), c
        assert c.block_m == 16 or m > 16, c  # no small-M waste
        assert c.block_k <= max(16, _pow2(k)), c
        stage = (c.block_m + c.block_n) * c.block_k * dtype.itemsize
        assert c.num_stages * stage <= H100_SXM.shared_memory_per_block, c


def test_large_problems_get_a_real_choice_and_decode_keeps_16_rows():
    big = gemm_candidates(4096, 4096, 4096, torch.float16, H100_SXM.shared_memory_per_block)
    assert len(big) >= 8
    assert {c.block_m for c in big} >= {64, 128} and 16 not in {c.block_m for c in big}
    decode = gemm_candidates(1, 4096, 4096, torch.bfloat16, H100_SXM.shared_memory_per_block)
    assert len(decode) >= 3 and {c.block_m for c in decode} == {16}


def test_a_block_k_that_needs_k_masks_is_left_out():
    """16 x 96 @ 96 x 100 in fp32: the heuristic's BLOCK_K (32) divides K, so
    the source has no K masks and BLOCK_K = 64 cannot launch it; K = 128 allows it."""
    heuristic = gemm_config(H100_SXM, 16, 100, 96, torch.float32)
    assert not masks_k(96, heuristic.block_k)
    assert 64 not in {c.block_k for c in gemm_candidates(16, 100, 96, torch.float32, 2**20)}
    assert 64 in {c.block_k for c in gemm_candidates(16, 100, 128, torch.float32, 2**20)}


def test_shared_memory_bounds_the_candidates():
    h100 = gemm_candidates(4096, 4096, 4096, torch.float16, H100_SXM.shared_memory_per_block)
    small = gemm_candidates(4096, 4096, 4096, torch.float16, 64 * 1024)
    assert len(small) < len(h100)
    for c in small[1:]:
        assert c.num_stages * (c.block_m + c.block_n) * c.block_k * 2 <= 64 * 1024


# --- options and the CPU message -------------------------------------------


def test_modes_and_the_autotune_option():
    assert Options().autotune is False
    assert Options.from_user(None, TUNE).autotune is True
    tuned = Options.from_user("max-autotune", None)
    assert tuned.autotune and tuned.cudagraphs  # as Inductor's mode
    no_graphs = Options.from_user("max-autotune-no-cudagraphs", None)
    assert no_graphs.autotune and not no_graphs.cudagraphs
    assert not Options.from_user("reduce-overhead", None).autotune
    assert not Options.from_user("default", None).autotune
    with pytest.raises(TypeError, match="option 'autotune' must be a bool, got 'yes'"):
        Options.from_user(None, {"autotune": "yes"})


def _dequantized(x, w_q):
    """A product ``auto`` makes a template on every target (a prologue)."""
    return x @ (w_q.to(torch.float32) * 0.02).t()


def test_without_cuda_it_warns_once_and_uses_the_heuristic(
    cache_root, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("TILEC_DUMP", str(tmp_path / "dump"))
    autotune._warn_no_device.cache_clear()
    x, w_q = _r(20, 40), torch.randint(-127, 128, (24, 40), dtype=torch.int8)
    launches = []
    with caplog.at_level(logging.WARNING, logger="tilec.autotune"):
        for fn in (_dequantized, lambda x, w_q: torch.relu(_dequantized(x, w_q))):
            torch._dynamo.reset()
            before = set(tilec.programs())
            compiled = torch.compile(fn, backend="tilec", mode="max-autotune")
            with torch.no_grad():
                torch.testing.assert_close(compiled(x, w_q), fn(x, w_q), atol=1e-4, rtol=1e-4)
            # Read now: the program goes with the next reset.
            launches += [s for p in new_programs(before) for s in p.launches()]
    (message,) = _warnings(caplog, "tilec.autotune")
    assert "max-autotune needs a CUDA device" in message and "heuristic" in message
    summaries = sorted((tmp_path / "dump").glob("*/summary.txt"))
    assert len(summaries) == 2
    for summary in summaries:
        assert "autotune: off: max-autotune needs a CUDA device" in summary.read_text()
    assert not list((cache_root / "autotune").iterdir())
    heuristic = gemm_config(INTERPRETER, 20, 24, 40, torch.float32)
    assert _gemm_configs(launches) == [heuristic, heuristic]


# --- tiles: selection, launch, disk cache ---------------------------------

# (function, input shapes): a ragged K, a K every candidate divides, a batch.
TUNED = {
    "ragged K": (lambda a, b: torch.relu(a @ b), [(20, 48), (48, 40)]),
    "even K": (lambda a, b: a @ b * 2, [(24, 64), (64, 40)]),
    "batched": (torch.bmm, [(2, 20, 48), (2, 48, 40)]),
}


def _candidates(name: str) -> list[GemmConfig]:
    _, (a, b) = TUNED[name]
    m, k, n = a[-2], a[-1], b[-1]
    interpreted = gemm_config(INTERPRETER, m, n, k, torch.float32)
    found = gemm_candidates(m, n, k, torch.float32, H100_SXM.shared_memory_per_block)
    return list(dict.fromkeys([interpreted, *found]))


@pytest.mark.parametrize(
    "name, index",
    [(name, i) for name in ("ragged K", "even K") for i in range(len(_candidates(name)))]
    + [("batched", -1)],
)
def test_the_program_launches_the_fastest_configuration(cache_root, timer, name, index):
    """Whichever candidate is fastest is what the program launches, and it
    computes what eager does (each BLOCK_K with the same source)."""
    fn, shapes = TUNED[name]
    favourite = _candidates(name)[index]
    fake = timer(config_is(favourite))
    launches = _compile(fn, *(_r(*s) for s in shapes), options={**TUNE, "matmul": "triton"})
    assert _gemm_configs(launches) == [favourite]
    assert {t.config for t in fake.trials} == set(_candidates(name))
    (step,) = launches
    *batch, m, _ = shapes[0]
    n = shapes[1][-1]
    tiles = -(-m // favourite.block_m) * -(-n // favourite.block_n)
    assert step.grid == (tiles * (batch[0] if batch else 1),)


def test_the_harness_launches_every_candidate_in_the_interpreter(cache_root, timer, tmp_path):
    """The fake timer runs each trial: real launches on inputs laid out like
    the kernel's arguments.  Ties go to the kernel's own configuration."""
    fake = timer(lambda trial: True, run=True)
    fn, shapes = TUNED["ragged K"]
    launches = _compile(
        fn, *(_r(*s) for s in shapes), options={**TUNE, "matmul": "triton"}, dump=tmp_path
    )
    assert len(fake.trials) == len(_candidates("ragged K"))
    assert _gemm_configs(launches) == [_candidates("ragged K")[0]]
    (report,) = tmp_path.glob("*/autotune.txt")
    text = report.read_text()
    assert "(measured)" in text and text.count(" ms  BLOCK_M=") == len(fake.trials)


def test_a_configuration_that_does_not_compile_is_skipped(cache_root, monkeypatch, tmp_path):
    fn, shapes = TUNED["even K"]
    wanted, broken = _candidates("even K")[1:3]

    def fake(trial: Trial) -> float:
        if trial.config == broken:
            raise OutOfResources(300000, 232448, "shared memory")
        return 1.0 if trial.config == wanted else 2.0

    monkeypatch.setitem(autotune.TIMERS, "cpu", fake)
    launches = _compile(
        fn, *(_r(*s) for s in shapes), options={**TUNE, "matmul": "triton"}, dump=tmp_path
    )
    assert _gemm_configs(launches) == [wanted]
    (report,) = tmp_path.glob("*/autotune.txt")
    assert f"failed      {broken}: OutOfResources" in report.read_text()


def test_a_second_compile_reads_the_disk_cache(cache_root, timer):
    fn, shapes = TUNED["ragged K"]
    inputs = [_r(*s) for s in shapes]
    favourite = _candidates("ragged K")[-1]
    first = timer(config_is(favourite))
    _compile(fn, *inputs, options={**TUNE, "matmul": "triton"})
    assert first.trials
    files = list((cache_root / "autotune").glob("*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    record = json.loads(files[0].read_text())
    assert record["key"]["triton"] and record["key"]["device"] and record["key"]["source"]
    assert GemmConfig(**record["best"]) == favourite
    second = timer(any_config)  # would pick another configuration if it measured
    launches = _compile(fn, *inputs, options={**TUNE, "matmul": "triton"})
    assert second.trials == []
    assert _gemm_configs(launches) == [favourite]


SECOND_PROCESS = """
import torch, tilec
from tilec.codegen import autotune

def refuse(trial):
    raise AssertionError("measured " + trial.label)

autotune.TIMERS["cpu"] = refuse
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(40, 72), torch.nn.GELU(), torch.nn.Linear(72, 24)).eval()
x = torch.randn(20, 40)
with torch.no_grad():
    out = torch.compile(mlp, backend="tilec", options={"autotune": True})(x)
    print((out - mlp(x)).abs().max().item())
(program,) = tilec.programs().values()
print(sorted(step.kernel.launch.constexprs["BLOCK_N"] for step in program.launches()))
"""


def test_another_process_measures_nothing(cache_root, timer):
    """Tiles and races measured here are read by a new process, whose timer
    fails if it is called."""
    mlp, x = _mlp(), _r(20, 40)
    fake = timer(lambda trial: trial.config is not None and trial.config.block_n == 32)
    launches = _compile(mlp, x)
    assert fake.trials and sorted(c.block_n for c in _gemm_configs(launches)) == [32, 32]
    run = subprocess.run(
        [sys.executable, "-c", SECOND_PROCESS], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    error, block_n = run.stdout.splitlines()
    assert float(error) < 1e-5 and block_n == "[32, 32]"


# --- the disk cache's trust rules ------------------------------------------


def _tuned_twice(cache_root, timer, damage: Callable[[Path], None]) -> tuple[FakeTimer, Path]:
    """Tune, ``damage`` the cache file, tune again: the second timer and the file."""
    fn, shapes = TUNED["even K"]
    inputs = [_r(*s) for s in shapes]
    timer(config_is(_candidates("even K")[-1]))
    _compile(fn, *inputs, options={**TUNE, "matmul": "triton"})
    (path,) = (cache_root / "autotune").glob("*.json")
    damage(path)
    second = timer(config_is(_candidates("even K")[1]))
    launches = _compile(fn, *inputs, options={**TUNE, "matmul": "triton"})
    assert _gemm_configs(launches) == [_candidates("even K")[1]]  # measured again
    return second, path


def test_a_cache_file_writable_by_others_is_refused(cache_root, timer, caplog):
    with caplog.at_level(logging.WARNING):
        second, path = _tuned_twice(cache_root, timer, lambda p: p.chmod(0o666))
    assert second.trials
    (message,) = _warnings(caplog, "tilec.cache")
    assert str(path) in message and "writable by other users" in message
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # replaced


@pytest.mark.skipif(not ROOT, reason="giving a file to another user needs root")
def test_a_cache_file_of_another_user_is_refused(cache_root, timer, caplog):
    with caplog.at_level(logging.WARNING):
        second, path = _tuned_twice(cache_root, timer, lambda p: os.chown(p, NOBODY, NOBODY))
    assert second.trials
    (message,) = _warnings(caplog, "tilec.cache")
    assert str(path) in message and f"owned by uid {NOBODY}" in message
    assert path.stat().st_uid == os.geteuid()


def _edit_best(path: Path) -> None:
    record = json.loads(path.read_text())
    record["best"]["block_k"] = 8  # a BLOCK_K the source was not written for
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda p: p.write_text("{"), "not JSON"),
        (_edit_best, "its answer is not one of the candidates"),
        (
            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "key": {}})),
            "written for another question",
        ),
    ],
    ids=["not json", "not a candidate", "another key"],
)
def test_a_damaged_cache_file_is_measured_again(cache_root, timer, caplog, damage, why):
    with caplog.at_level(logging.WARNING):
        second, path = _tuned_twice(cache_root, timer, damage)
    assert second.trials
    (message,) = _warnings(caplog, "tilec.autotune")
    assert str(path) in message and why in message


# --- library or template ----------------------------------------------------


def _plain(x, w):
    """A product with nothing to fuse under the interpreter: ``auto`` keeps the library."""
    return torch.relu(x @ w)


def test_the_library_call_stays_when_it_is_faster(cache_root, timer, tmp_path):
    fake = timer(library)
    launches = _compile(_plain, _r(20, 48), _r(48, 40), dump=tmp_path)
    assert not _gemm_configs(launches) and tilec.stats()["extern_calls"] == 1
    assert [t.config is None for t in fake.trials].count(True) == 1
    (fuse,) = tmp_path.glob("*/*-fuse.txt")
    (line,) = [line for line in fuse.read_text().splitlines() if "%mm: " in line]
    assert "library %mm: auto: no prologue to fuse" in line and "[raced_library_faster]" in line
    assert "autotune: template 2.0000 ms (BLOCK_M=" in line and "vs library 1.0000 ms" in line


def test_the_template_wins_when_it_is_faster_and_the_race_is_remembered(
    cache_root, timer, tmp_path
):
    fake = timer(any_config)
    x, w = _r(20, 48), _r(48, 40)
    launches = _compile(_plain, x, w, dump=tmp_path / "first")
    assert len(_gemm_configs(launches)) == 1 and tilec.stats()["extern_calls"] == 0
    assert any(t.config is None for t in fake.trials)
    (fuse,) = (tmp_path / "first").glob("*/*-fuse.txt")
    assert "matmul: template %mm: autotune: template 1.0000 ms" in fuse.read_text()
    again = timer(library)  # the library would win if it were measured again
    launches = _compile(_plain, x, w, dump=tmp_path / "second")
    assert again.trials == [] and len(_gemm_configs(launches)) == 1
    (fuse,) = (tmp_path / "second").glob("*/*-fuse.txt")
    assert "vs library 1.5000 ms, from the autotune cache" in fuse.read_text()
    (summary,) = (tmp_path / "second").glob("*/summary.txt")
    assert (
        "0 GEMM kernels tuned, 1 from the cache; 0 matmuls raced against the library, "
        "1 from the cache"
    ) in summary.read_text()


def test_the_bare_template_is_the_call_alone():
    """What a race measures: the call's operand buffers as inputs (a
    transposed weight stays a view of its buffer), one kernel, the same values."""
    x, w, b = _r(6, 20), _r(9, 20), _r(9)
    graph = lower(lambda x, w, b: torch.addmm(b, x, w.t(), beta=0.5), x, w, b)
    (call,) = [n for n in graph.nodes.values() if n.kind == "extern"]
    bare = _bare(graph, call)
    assert [bare.nodes[n].shape for n in bare.inputs] == [(9,), (6, 20), (9, 20)]
    assert [n.kind for n in bare.nodes.values()].count("view") == 1
    (group,) = bare.groups
    assert group.stored == (call.name,)
    (out,) = interpret(bare, [b, x, w])
    torch.testing.assert_close(out, torch.addmm(b, x, w.t(), beta=0.5))
    kernel_entry(bare, group, write_kernel(bare, group, INTERPRETER))


def test_symbolic_sizes_are_not_raced():
    def boom(bare, call):
        raise AssertionError("raced a symbolic matmul")

    gm = aten_graph(_plain, _r(20, 48), _r(48, 40), tracing_mode="symbolic")
    graph, _ = lower_graph(gm, "test", RULES, None)
    out, counts = choose_matmul(graph, "auto", target=INTERPRETER, race=boom)
    assert counts["matmul_library"] == 1
    assert not graph.decisions  # the pass leaves its input alone
    assert out.decisions[-1].reason == "not_raced_symbolic"
    assert "autotune: symbolic sizes (generic variant), not measured" in out.decisions[-1].text()


def test_the_generic_variant_is_not_tuned(cache_root, timer, tmp_path):
    fake = timer(any_config)
    compiled = torch.compile(
        lambda x, w: torch.relu(x @ w),
        backend="tilec",
        dynamic=True,
        options={**TUNE, "matmul": "triton", "max_specializations": 0, "dump": str(tmp_path)},
    )
    w = _r(20, 9)
    with torch.no_grad():
        for rows in (3, 17):
            x = _r(rows, 20)
            torch.testing.assert_close(compiled(x, w), torch.relu(x @ w), atol=1e-4, rtol=1e-4)
    assert fake.trials == []
    (report,) = tmp_path.glob("*generic/autotune.txt")
    assert "not tuned: symbolic sizes" in report.read_text()


# --- on a GPU -------------------------------------------------------------


@pytest.mark.gpu
def test_max_autotune_on_cuda_measures_once(cache_root, monkeypatch, tmp_path):
    """An fp16 MLP with mode="max-autotune" on CUDA: both GEMMs are measured
    (the second, with nothing to fuse, also against cuBLAS), the answers are
    written to the cache, the result matches eager, and a second compile
    reads every answer and measures nothing.  In float32 the cost model
    prices the template below cuBLAS (no TF32: measured 5.7 TFLOP/s), so the
    first GEMM would go back to the library before anything is tuned."""
    calls: list[str] = []

    def counting(trial: Trial) -> float:
        calls.append(trial.label)
        return autotune.cuda_timer(trial)

    monkeypatch.setitem(autotune.TIMERS, "cuda", counting)
    monkeypatch.setenv("TILEC_DUMP", str(tmp_path / "dump"))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    ).to("cuda", torch.float16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    for attempt in ("first", "second"):
        torch._dynamo.reset()
        before = set(tilec.programs())
        compiled = torch.compile(mlp, backend="tilec", mode="max-autotune")
        with torch.no_grad():
            for _ in range(3):  # warm-up, capture, replay
                torch.testing.assert_close(compiled(x), mlp(x), atol=1e-2, rtol=1e-2)
        (program,) = new_programs(before)
        assert [s.kernel.template for s in program.launches()].count("gemm") >= 1
        if attempt == "first":
            assert calls and "library" in calls
            assert list((cache_root / "autotune").glob("*.json"))
            calls.clear()
        else:
            assert calls == []
    summaries = sorted((tmp_path / "dump").glob("*/summary.txt"))
    assert "0 GEMM kernels tuned" in summaries[-1].read_text()
