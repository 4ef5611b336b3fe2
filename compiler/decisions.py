"""Decisions: what the compiler chose, and why, as records.

Each pass that chooses between alternatives (fusion, a matmul's template or
library call, layout, quantization) appends a :class:`Decision` to
``Graph.decisions``; the runtime makes one for graph capture.  A decision
is data: the stage that made it, what it is about, what became of it, a
reason *code* (stable: tests, reports and tools compare it) and the same in
words with the specifics (the dump's text).  Where a decision weighed
memory traffic or predicted times, they are fields too.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

STAGES = ("fuse", "matmul", "layout", "quantize", "memory", "capture")


class Reason(NamedTuple):
    """Why: a stable code, and the specifics in words."""

    code: str
    detail: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """One choice: ``stage`` decided ``outcome`` for ``subject`` because of
    ``reason`` (a code; ``detail`` says it in words)."""

    stage: str
    subject: str
    outcome: str
    reason: str
    detail: str = ""
    bytes_saved: int | None = None
    # Predicted seconds of each alternative weighed, e.g. (("library", 3e-6),
    # ("template", 2e-6)).
    predicted_s: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"unknown decision stage {self.stage!r}; expected one of {STAGES}")

    @classmethod
    def of(cls, stage: str, subject: str, outcome: str, why: Reason, **fields) -> Decision:
        return cls(stage, subject, outcome, why.code, why.detail, **fields)

    def text(self) -> str:
        """One line for the dump: ``fused {%a} + {%b}: producer->consumer, saves 64 bytes``."""
        line = f"{self.outcome} {self.subject}: {self.detail or self.reason}"
        if self.bytes_saved is not None:
            line += f", saves {self.bytes_saved} bytes"
        if self.predicted_s:
            times = ", ".join(
                f"{what} {seconds * 1e6:.2f} us" for what, seconds in self.predicted_s
            )
            line += f" (predicted: {times})"
        return f"{line} [{self.reason}]"


def of_stage(decisions: list[Decision], stage: str) -> list[Decision]:
    """The decisions ``stage`` made, in order."""
    return [d for d in decisions if d.stage == stage]
