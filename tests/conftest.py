import contextlib
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

import tilec
from tilec.codegen.cache import ENV as KERNEL_CACHE
from tilec.codegen.record import ENV as RECORD_KERNELS

# Every cache the suite writes to, pointed into the session's scratch folder.
CACHES = (KERNEL_CACHE, "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# The (backend, op) pairs that hold a float32 precision (``fp32_precision``).
FP32_PRECISIONS = [("generic", "all")] + [
    (backend, op) for backend in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")
]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """One scratch folder for the session, removed at its end: the kernel caches
    of tilec, Triton and Inductor (tests neither read a user's caches nor leave
    files in them), pytest's ``tmp_path`` folders (unless ``--basetemp`` is
    given), and the record of every kernel the session generates, for the PTX
    tier (tests/test_ptx.py).  Subprocesses inherit the variables."""
    scratch = tempfile.mkdtemp(prefix="tilec-tests-")
    variables = {var: os.path.join(scratch, var.lower()) for var in CACHES}
    variables[RECORD_KERNELS] = os.path.join(scratch, "kernels.jsonl")
    environment = mock.patch.dict(os.environ, variables)
    environment.start()
    config.add_cleanup(lambda: shutil.rmtree(scratch, ignore_errors=True))
    config.add_cleanup(environment.stop)
    config.tilec_scratch = scratch
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(scratch, "pytest")


def pytest_collection_modifyitems(config, items):
    # The PTX tier compiles the kernels every other test generated: it runs
    # last, and a process compiles them meanwhile (tests/ptx_background.py).
    items.sort(key=lambda item: item.path.name == "test_ptx.py")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
    if any(item.path.name == "test_ptx.py" for item in session.items):
        _start_ptx_background(session.config)


def _start_ptx_background(config) -> None:
    """Start the PTX tier's compiler (``config.ptx_background``: the
    process, its results file, the file that tells it to finish, its log),
    with a Triton cache of its own (a cache hit would skip ptxas and its
    spill report); stopped at the session's end if the tier did not run."""
    scratch = Path(config.tilec_scratch)
    results, done, log = (scratch / name for name in ("ptx.jsonl", "ptx.done", "ptx.log"))
    env = dict(os.environ, TRITON_CACHE_DIR=str(scratch / "triton_ptx"))
    args = [sys.executable, "-m", "tests.ptx_background", os.environ[RECORD_KERNELS]]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*args, str(results), str(done)], env=env, stdout=out, stderr=subprocess.STDOUT,
            cwd=str(config.rootpath),
        )  # fmt: skip
    config.ptx_background = (process, results, done, log)

    def stop() -> None:
        done.touch()
        if process.poll() is None:
            process.kill()
            process.wait()

    config.add_cleanup(stop)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and starts with zeroed tilec stats,
    and leaves no compiled program behind for ``tilec.programs()`` of the
    next: training's programs sit in reference cycles (autograd's graph)
    until a collection, which runs only where one is left."""
    torch._dynamo.reset()
    tilec.reset_stats()
    yield
    torch._dynamo.reset()
    if tilec.programs():
        gc.collect()


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
