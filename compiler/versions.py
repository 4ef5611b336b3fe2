"""The torch and triton releases tilec is tested with.

tilec's package pins only lower bounds (``torch>=2.11``, ``triton>=3.6``):
an upper bound would make pip replace a user's newer torch or triton when
tilec is installed beside it, and installing a ``torch.compile`` backend
must never change the user's torch.  Instead, importing tilec checks the
pair it finds against the pairs each torch release pins (read from the
releases' own metadata) and warns once when the pair was never tested.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings

# torch (major, minor) -> the triton (major, minor) that release pins on Linux.
TESTED = {
    (2, 11): (3, 6),
    (2, 12): (3, 7),
    (2, 13): (3, 7),
    (2, 14): (3, 8),
}


def major_minor(version: str) -> tuple[int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return int(match[1]), int(match[2])


def untested(torch_version: str, triton_version: str) -> str | None:
    """Why this torch/triton pair is outside what tilec is tested with, or None."""
    torch_release, triton_release = major_minor(torch_version), major_minor(triton_version)
    supported = ", ".join(f"torch {a}.{b} with triton {c}.{d}" for (a, b), (c, d) in TESTED.items())
    if torch_release not in TESTED:
        return f"tilec is tested with {supported}; this is torch {torch_version}"
    if TESTED[torch_release] != triton_release:
        return (
            f"torch {torch_version} pins triton {'.'.join(map(str, TESTED[torch_release]))}, "
            f"but triton {triton_version} is installed (tilec is tested with {supported})"
        )
    return None


def check_installed() -> None:
    """Warn once if the installed torch and triton are not a tested pair."""
    try:
        found = importlib.metadata.version("torch"), importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return  # a source build: nothing to compare
    reason = untested(*found)
    if reason is not None:
        warnings.warn(f"tilec: {reason}", stacklevel=3)
