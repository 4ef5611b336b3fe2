"""Progress lines on stderr for the long benchmark loops.

A full zoo or decode run takes many minutes: each measurement prints a line
to stderr when it starts and one when it ends, with the seconds it took and
the seconds since the run began.  Plain lines, so a log file shows them as
they come; the report on stdout is untouched.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """``start(label)``, then ``end(outcome)``, for each of ``total`` measurements:

    ``[3/9 41s] gpt2 tilec inference float32 ...``
    ``[3/9 47s] gpt2 tilec inference float32: ok in 6.2s``
    """

    def __init__(self, total: int) -> None:
        self.total, self.count = total, 0
        self.began = self.started = time.perf_counter()
        self.label = ""

    def start(self, label: str) -> None:
        self.count += 1
        self.label, self.started = label, time.perf_counter()
        self._print(f"{label} ...")

    def end(self, outcome: str = "done") -> None:
        self._print(f"{self.label}: {outcome} in {time.perf_counter() - self.started:.1f}s")

    def _print(self, text: str) -> None:
        elapsed = time.perf_counter() - self.began
        print(f"[{self.count}/{self.total} {elapsed:.0f}s] {text}", file=sys.stderr, flush=True)
