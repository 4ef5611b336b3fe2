"""The PTX tier's compiler, run beside the suite's tests.

The kernels the suite records for the PTX tier (``$TILEC_RECORD_KERNELS``:
one JSON line per kernel) are compiled for sm_90 while it runs, by this
process (on the core a one-process suite leaves idle), which
``tests/conftest.py`` starts when the session collects ``tests/test_ptx.py``:

    python -m tests.ptx_background RECORD RESULTS DONE EXIT

It follows RECORD, compiles each new source once (``benchmarks.sm90
.compile_kernel``) and appends each result, with the source's digest
(:func:`digest`), to RESULTS, a kernel at a time, until the file DONE
exists: the PTX tier touches it when it runs, after every other test, and
the compiler exits after the kernel it is compiling.  While it has caught
up with RECORD, it also compiles the tier's own corpus
(``tests/test_ptx._corpus_entries``, made here once).  The tier then reads
RESULTS (:func:`read_results`) and compiles what is not in it, on every
core: what this process had not reached (under pytest-xdist the suite
keeps both cores busy, and this process falls behind) and the rest of the
corpus.

Its files live in the session's scratch folder (:class:`Files`), so that
the tier finds them from any process: under pytest-xdist the controller
starts the compiler (:func:`start`), and the worker that runs the tier
ends it (:func:`finish`), which reads its exit status from EXIT.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# How long the compiler sleeps when it has caught up with the record.
POLL_S = 0.5


@dataclass(frozen=True)
class Files:
    """The compiler's files in a session's scratch folder."""

    scratch: Path

    @property
    def results(self) -> Path:
        return self.scratch / "ptx.jsonl"

    @property
    def done(self) -> Path:
        return self.scratch / "ptx.done"

    @property
    def log(self) -> Path:
        return self.scratch / "ptx.log"

    @property
    def exit(self) -> Path:
        """The compiler's exit status, written as it exits."""
        return self.scratch / "ptx.exit"

    @property
    def finished(self) -> Path:
        """The session's finished tests, a node id a line (:func:`mark_finished`)."""
        return self.scratch / "finished.txt"

    @property
    def started(self) -> bool:
        return self.log.exists()


def start(files: Files, record: str, cwd: str) -> subprocess.Popen:
    """Start the compiler on RECORD, with a Triton cache of its own (a cache
    hit would skip ptxas and its spill report)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(files.scratch / "triton_ptx"))
    args = [sys.executable, "-m", "tests.ptx_background", record]
    with files.log.open("w") as out:
        return subprocess.Popen(
            [*args, str(files.results), str(files.done), str(files.exit)],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
        )  # fmt: skip


def finish(files: Files, timeout: float) -> str | None:
    """Tell the compiler to stop and wait for it to exit: None once it has
    exited cleanly, else what went wrong."""
    files.done.touch()
    deadline = time.monotonic() + timeout
    while not files.exit.exists():
        if time.monotonic() > deadline:
            return f"the background PTX compiler did not finish in {timeout:.0f} s"
        time.sleep(POLL_S)
    status = files.exit.read_text().strip()
    if status != "0":
        return f"the background PTX compiler failed ({status}):\n{files.log.read_text()[-3000:]}"
    return None


def mark_finished(files: Files, nodeid: str) -> None:
    """Add a finished test to the session's list (one write, appended:
    xdist's workers share the list)."""
    fd = os.open(files.finished, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (nodeid + "\n").encode())
    finally:
        os.close(fd)


def wait_finished(files: Files, nodeids: set[str], timeout: float) -> set[str]:
    """Wait until the tests ``nodeids`` have finished, in any process of the
    session; those still unfinished after ``timeout`` seconds."""
    path = files.finished
    deadline = time.monotonic() + timeout
    while True:
        left = nodeids - set(path.read_text().splitlines() if path.exists() else ())
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(POLL_S)


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """The compiled kernels in RESULTS, by their source's digest."""
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    return {r["digest"]: r for r in (json.loads(line) for line in lines if line.strip())}


def _new_entries(record: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Entries recorded after byte ``offset`` (whole lines only: each is
    appended in one write), and the offset after them."""
    if not record.exists():
        return [], offset
    with record.open("rb") as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    entries = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
    return entries, offset + len(complete)


def _corpus() -> list[dict[str, Any]]:
    """The PTX tier's corpus entries.  Its kernels are not the session's:
    they are not recorded."""
    from tilec.codegen.record import ENV

    os.environ.pop(ENV, None)
    from tests.test_ptx import _corpus_entries

    return _corpus_entries()


def main(argv: list[str]) -> int:
    from benchmarks.sm90 import compile_kernel

    record, results, done = (Path(a) for a in argv[:3])
    seen: set[str] = set()
    offset = 0
    corpus: list[dict[str, Any]] | None = None

    def compile_once(entry: dict[str, Any]) -> None:
        key = digest(entry["source"])
        if key in seen:
            return
        seen.add(key)
        result = compile_kernel(entry) | {"digest": key}
        with results.open("a") as f:
            f.write(json.dumps(result) + "\n")

    pending: list[dict[str, Any]] = []
    while not done.exists():
        entries, offset = _new_entries(record, offset)
        pending += entries
        if pending:
            compile_once(pending.pop(0))
            continue
        if corpus is None:
            corpus = _corpus()
        if corpus:
            compile_once(corpus.pop(0))
        else:
            time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    exit_file = Path(sys.argv[4])
    try:
        status = main(sys.argv[1:4])
    except BaseException:
        traceback.print_exc()
        exit_file.write_text("an exception, in the log above")
        raise
    exit_file.write_text(str(status))
    sys.exit(status)
