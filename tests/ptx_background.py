"""The PTX tier's compiler, run beside the suite on the core it leaves idle.

Most of the suite runs one thread (the Triton interpreter), so the kernels
it records for the PTX tier (``$TILEC_RECORD_KERNELS``: one JSON line per
kernel) are compiled for sm_90 while it runs, by this process, which
``tests/conftest.py`` starts when the session collects ``tests/test_ptx.py``:

    python -m tests.ptx_background RECORD RESULTS DONE

It follows RECORD, compiles each new source once (``benchmarks.sm90
.compile_kernel``) and appends each result, with the source's digest
(:func:`digest`), to RESULTS; once the file DONE exists (the PTX tier
touches it when it runs, after every other test) it compiles what is left
of RECORD and exits.  While it has caught up with RECORD and DONE is not
there yet, it also compiles the tier's own corpus
(``tests/test_ptx._corpus_entries``, made here once, a kernel at a time
between looks at RECORD), which the tier would otherwise compile after
every other test, on both cores.  The tier then reads RESULTS
(:func:`read_results`) and compiles only what is not in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# How long the compiler sleeps when it has caught up with the record.
POLL_S = 0.5


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

    record, results, done = (Path(a) for a in argv)
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

    while True:
        finished = done.exists()  # before reading: nothing is recorded after it
        entries, offset = _new_entries(record, offset)
        for entry in entries:
            compile_once(entry)
        if finished and not entries:
            return 0
        if entries or finished:
            continue
        if corpus is None:
            corpus = _corpus()
        if corpus:
            compile_once(corpus.pop(0))
        else:
            time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
