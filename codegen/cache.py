"""On-disk cache of generated kernel modules, keyed by a hash of their source.

Same source, same file: a second compile of the same graph imports the module
that is already there.  The directory is per user (``$TILEC_CACHE_DIR`` or
``~/.cache/tilec``), created private (0700); files are written to a temporary
name and renamed into place, so a concurrent reader never sees half a file.
Whether Triton interprets a kernel is fixed when its module is imported, so
interpreted and compiled imports of one file are separate modules.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType


def cache_dir() -> Path:
    root = os.environ.get("TILEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tilec"
    )
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def write_source(source: str) -> Path:
    """Store ``source`` under its content hash; returns the file's path."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:32]
    path = cache_dir() / f"k_{digest}.py"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    return path


def load_module(path: Path, interpret: bool) -> ModuleType:
    """Import a kernel module, interpreted by Triton or compiled for the GPU."""
    name = f"tilec_kernels.{path.stem}{'_interp' if interpret else ''}"
    if name in sys.modules:
        return sys.modules[name]
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    sys.modules[name] = module
    return module
