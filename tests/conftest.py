import contextlib
import gc
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch._dynamo.guards

import tilec
from tests import ptx_background
from tilec.codegen.cache import ENV as KERNEL_CACHE
from tilec.codegen.record import ENV as RECORD_KERNELS

# Every cache the suite writes to, pointed into the session's scratch folder.
CACHES = (KERNEL_CACHE, "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# The session's scratch folder, for xdist's workers (and the PTX tier).
SCRATCH = "TILEC_TESTS_SCRATCH"
NO_LINE_INFO = "TRITON_DISABLE_LINE_INFO"
# The (backend, op) pairs that hold a float32 precision (``fp32_precision``).
FP32_PRECISIONS = [("generic", "all")] + [
    (backend, op) for backend in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")
]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """One scratch folder for the session, removed at its end: the kernel caches
    of tilec, Triton and Inductor (tests neither read a user's caches nor leave
    files in them), pytest's ``tmp_path`` folders (unless ``--basetemp`` is
    given), the record of every kernel the session generates, for the PTX
    tier (tests/test_ptx.py), and the list of tests finished, which the tier
    waits on.  Subprocesses inherit the variables; so do pytest-xdist's
    workers (``-n``), which share the controller's folder."""
    _no_guard_latency_profile(config)
    _files_in_collection_order(config)
    if hasattr(config, "workerinput"):  # an xdist worker
        config.tilec_scratch = os.environ[SCRATCH]
        return
    scratch = tempfile.mkdtemp(prefix="tilec-tests-")
    variables = {var: os.path.join(scratch, var.lower()) for var in CACHES}
    variables[RECORD_KERNELS] = os.path.join(scratch, "kernels.jsonl")
    variables[SCRATCH] = scratch
    # Kernels compiled for sm_90 (the PTX tier, the static reports' tests)
    # without line info: the same registers, spills, shared memory and
    # global accesses (46 kernels of four zoo models compared), 9 % less
    # compile time, most of it the PTX tier's.
    variables[NO_LINE_INFO] = "1"
    environment = mock.patch.dict(os.environ, variables)
    environment.start()
    config.add_cleanup(lambda: shutil.rmtree(scratch, ignore_errors=True))
    config.add_cleanup(environment.stop)
    config.tilec_scratch = scratch
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(scratch, "pytest")


def _files_in_collection_order(config) -> None:
    """Under ``--dist loadfile``, xdist hands out files in the order the
    collection holds them (:func:`pytest_collection_modifyitems`: the PTX
    tier last), not by its default, most tests first.  That default sent
    the tier's file (a dozen tests) 34th of 73: its worker then waited in
    the tier's setup for the rest of the suite, which the other worker ran
    alone (378 s of a 19 min 44 s suite on this project's 2-core machine).
    In collection order the tier's setup waited under 14 s (2026-12-03)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _no_guard_latency_profile(config) -> None:
    """Dynamo times the guards of every frame it compiles once, after
    flushing the CPU's caches (``profile_guard_manager`` in
    torch/_dynamo/guards.py), for one metric, ``guard_latency_us``, that it
    logs and nothing reads: 27 ms a compile on this project's CPU machine
    (torch 2.13), a quarter of ``test_lowering.py``'s time.  No test reads
    the metric, so the session skips the measurement (0 us; the guards
    themselves are built and checked as before).  Subprocesses that tests
    start still pay it."""
    guards = torch._dynamo.guards
    if hasattr(guards, "profile_guard_manager"):
        patch = mock.patch.object(guards, "profile_guard_manager", lambda *args: 0.0)
        patch.start()
        config.add_cleanup(patch.stop)


def pytest_collection_modifyitems(config, items):
    # The PTX tier compiles the kernels every other test generated: it runs
    # last (under xdist's ``--dist loadfile``, its file is the last sent to
    # a worker, and it waits for the others to finish), and a
    # process compiles them meanwhile (tests/ptx_background.py).
    items.sort(key=lambda item: _in_ptx_tier(item.nodeid))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _in_ptx_tier(nodeid: str) -> bool:
    return nodeid.split("::")[0].endswith("test_ptx.py")


def pytest_collection_finish(session):
    # What collection imported (torch, transformers, the test modules) lives
    # for the whole session: moved out of the garbage collector's sight, a
    # full collection no longer walks it (a quarter of a second each, taken
    # every few tests, and by the fixture below); and the young generation
    # is collected less often (a compile makes objects by the hundred
    # thousand).  Together about a tenth of the suite's time.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    # After every plugin's deselection: only a session that runs the tier.
    # An xdist worker leaves it to the controller, which outlives it.
    if not hasattr(session.config, "workerinput"):
        _start_ptx_background(session.config, [item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The xdist controller: each worker collected the same tests."""
    _start_ptx_background(node.config, ids)


def _start_ptx_background(config, nodeids: list[str]) -> None:
    """Start the PTX tier's compiler once, where the session runs the tier;
    stopped at the session's end (if the tier did not end it first)."""
    files = ptx_background.Files(Path(config.tilec_scratch))
    if files.started or not any(_in_ptx_tier(nodeid) for nodeid in nodeids):
        return
    process = ptx_background.start(files, os.environ[RECORD_KERNELS], str(config.rootpath))

    def stop() -> None:
        files.done.touch()
        if process.poll() is None:
            process.kill()
            process.wait()

    config.add_cleanup(stop)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Listed once run (in the process that ran it, not again by xdist's
    controller) for the PTX tier, which waits for every other test."""
    yield
    if not _in_ptx_tier(item.nodeid):
        files = ptx_background.Files(Path(item.config.tilec_scratch))
        ptx_background.mark_finished(files, item.nodeid)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and starts with zeroed tilec stats
    and torch's random numbers seeded (the same inputs whatever ran before
    it in its process: xdist gives a worker different files from run to
    run), and leaves no compiled program behind for ``tilec.programs()`` of
    the next: training's programs sit in reference cycles (autograd's
    graph) until a collection, which runs only where one is left.  What
    that collection leaves alive is then frozen (``gc.freeze``), so the
    next one walks only what later tests made: late in a suite, a full
    collection of a worker's heap took 1.5 to 3 s, 144 s of a suite's
    teardown (16 s after, 2026-12-03); an object frozen and later dropped in a cycle
    is never freed, which did not raise five files' peak memory (959 MB
    before, 929 after).  A
    program still alive after it leaked (something outside the test holds
    it): the test that compiled it errors, not a later one that counts
    programs in the same worker.  A test that failed holds its programs in
    its traceback's frames, which pytest keeps for post-mortem debugging
    (``sys.last_traceback``) after the report is written: they are cleared,
    so a failure is reported once, as itself."""
    torch._dynamo.reset()
    tilec.reset_stats()
    torch.manual_seed(0)
    yield
    if getattr(sys, "last_traceback", None) is not None:
        traceback.clear_frames(sys.last_traceback)
        sys.last_type = sys.last_value = sys.last_traceback = None
    torch._dynamo.reset()
    if tilec.programs():
        gc.collect()
        gc.freeze()
    leaked = sorted(tilec.programs())
    assert not leaked, f"compiled programs outlived the test: {leaked}"


@contextlib.contextmanager
def float32_precision_kept():
    """Restore the float32 precision settings on exit (``torch.backends.cuda
    .matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``, the float32
    matmul precision, and the per-backend ``fp32_precision`` they are kept
    in).  Through ``torch._C``: torch's public setters refuse a cuDNN flag
    once its test utilities are imported (the OpInfo tier), and mixes of the
    legacy and the ``fp32_precision`` settings."""
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch._C._get_cudnn_allow_tf32()
    per_backend = {p: torch._C._get_fp32_precision_getter(*p) for p in FP32_PRECISIONS}
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        for pair, value in per_backend.items():
            torch._C._set_fp32_precision_setter(*pair, value)
        torch._C._set_cudnn_allow_tf32(cudnn_tf32)


@pytest.fixture(autouse=True)
def fp32_precision_restored():
    """No test leaks a float32 precision setting into the tests after it."""
    with float32_precision_kept():
        yield
