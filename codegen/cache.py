"""On-disk cache of generated kernel modules, keyed by a hash of their source.

Same source, same file: ``k_<sha256 prefix>.py``.  The folder is
``$TILEC_CACHE_DIR/kernels``, by default ``~/.cache/tilec/kernels`` (or under
``$XDG_CACHE_HOME``).  Beside it, ``autotune/`` holds what max-autotune
measured (``codegen/autotune.py``), under the same trust rules
(:func:`read_private`, :func:`write_private`).  Deleting the cache is always
safe: tilec writes what it needs again.

Kernel files are executed, so the cache is a trust boundary:

- Folders tilec creates are private (0700) whatever the umask.  A cache folder
  owned by another user or writable by group or others is refused, and so is
  one tilec cannot create or write: the process then uses a private temporary
  folder, removed at exit, with one warning that names ``TILEC_CACHE_DIR``.
- A cached file is used only if it is a regular file of this user, writable
  by no one else, with exactly the bytes tilec generated.  Anything else (an
  edited, truncated or unreadable file) is logged as a warning with its path
  and replaced; it is never executed.
- A module executes the bytes that were checked against the hash in its name,
  and Triton reads the kernel's source from those same bytes (through
  :mod:`linecache`), so a file changed after the check is never run.

Files are written to a temporary name and renamed into place, so a concurrent
reader never sees half a file.  Whether Triton interprets a kernel is fixed
when its module is imported, so interpreted and compiled imports of one file
are separate modules.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import linecache
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from tilec.codegen import interpreter_reduce

log = logging.getLogger("tilec.cache")

ENV = "TILEC_CACHE_DIR"
# Hex digits of the source's SHA-256 in a file name.
DIGEST_CHARS = 32


class CacheError(RuntimeError):
    """A cached kernel file does not hold what its name says."""


class _Unusable(Exception):
    """A cache folder that is not used, and why: ``_Unusable(path, reason)``."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def _configured_root() -> Path:
    configured = os.environ.get(ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tilec"


def _untrusted(st: os.stat_result) -> str | None:
    """Why a file or folder with this status may have been written by someone else."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


def _private_dir(path: Path) -> None:
    """Create ``path`` and its missing parents as 0700 folders (chmod: the umask
    must not widen them); refuse it if it exists and is not private to this user."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass  # created concurrently: checked below like any existing folder
        else:
            os.chmod(folder, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _Unusable(path, "not a folder")
    problem = _untrusted(st)
    if problem:
        raise _Unusable(path, problem)


def _check_writable(folder: Path) -> None:
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
    os.close(fd)
    os.unlink(probe)


@functools.cache
def _fallback_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="tilec-cache-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# The cache root's folders: kernel sources, and autotuning results.
FOLDERS = ("kernels", "autotune")


@functools.cache
def _checked_root(root: Path) -> Path:
    """The cache root used for the configured ``root``: ``root`` once it and
    its :data:`FOLDERS` are private and writable, else a private temporary
    folder (one check and at most one warning per root and process)."""
    path = root
    try:
        _private_dir(root)
        for name in FOLDERS:
            path = root / name
            _private_dir(path)
            _check_writable(path)
    except _Unusable as err:
        where, reason = err.args
    except OSError as err:
        where, reason = err.filename or path, err.strerror or str(err)
    else:
        return root
    fallback = _fallback_dir()
    for name in FOLDERS:
        _private_dir(fallback / name)
    log.warning(
        "tilec: kernel cache %s is not usable (%s); this process uses the private "
        "temporary folder %s instead. Set %s to a folder only you can write to.",
        where,
        reason,
        fallback,
        ENV,
    )
    return fallback


def cache_dir(folder: str = "kernels") -> Path:
    """The folder kernel files (or, ``folder="autotune"``, autotuning results)
    are cached in: under a private temporary folder when the configured one
    cannot be trusted or written."""
    assert folder in FOLDERS, folder
    return _checked_root(_configured_root()) / folder


def _trust_problem(path: Path) -> str | None:
    """Why the file at ``path`` may not be what this user wrote ("missing" if absent)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return _untrusted(st)


def _stored_problem(path: Path, data: bytes) -> str | None:
    """Why the file at ``path`` cannot stand for ``data`` ("missing" if absent)."""
    problem = _trust_problem(path)
    if problem:
        return problem
    try:
        with open(path, "rb") as f:
            stored = f.read()
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if stored != data:
        return f"its content differs from the generated source ({len(stored)} of {len(data)} bytes; edited or truncated)"
    return None


def _store(folder: Path, data: bytes) -> Path:
    path = folder / f"k_{_digest(data)}.py"
    problem = _stored_problem(path, data)
    if problem is None:
        return path
    _write_atomic(path, data)
    if problem != "missing":
        log.warning("tilec: replaced cached kernel file %s: %s", path, problem)
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as a file only this user can read or write,
    atomically: a concurrent reader sees the old file or the new one, never
    half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _in_cache(folder: str, write: Callable[[Path], Path]) -> Path:
    try:
        return write(cache_dir(folder))
    except OSError:
        # The folder changed after it was checked (deleted, made read-only): check again.
        _checked_root.cache_clear()
        return write(cache_dir(folder))


def write_private(folder: str, filename: str, data: bytes) -> Path:
    """Store ``data`` as ``filename`` in the cache folder ``folder``
    (atomically, readable and writable by this user alone); returns the path."""

    def write(directory: Path) -> Path:
        _write_atomic(directory / filename, data)
        return directory / filename

    return _in_cache(folder, write)


def read_private(path: Path) -> bytes | None:
    """The bytes of a cache file that this user alone can have written; None
    when it is missing.  A file that may have been written by someone else
    (a link, another user's file, one writable by group or others) or that
    cannot be read is logged as a warning with its path and treated as
    missing, so the caller computes its content again and replaces it."""
    problem = _trust_problem(path)
    if problem == "missing":
        return None
    if problem is None:
        try:
            return path.read_bytes()
        except OSError as err:
            problem = f"unreadable ({err.strerror})"
    log.warning("tilec: ignored cache file %s: %s", path, problem)
    return None


def write_source(source: str) -> Path:
    """Store ``source`` under its content hash; returns the file's path.  A file
    already there is kept only if it holds exactly ``source``."""
    data = source.encode()
    return _in_cache("kernels", lambda directory: _store(directory, data))


def load_module(path: Path, interpret: bool) -> ModuleType:
    """Import a kernel module, interpreted by Triton or compiled for the GPU.

    Raises :class:`CacheError` if the file's bytes do not hash to the digest in
    its name; the module runs the bytes that were checked."""
    name = f"{interpreter_reduce.KERNEL_MODULES}{path.stem}{'_interp' if interpret else ''}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CacheError(f"tilec: cannot read cached kernel file {path}: {err.strerror}") from err
    if f"k_{_digest(data)}" != path.stem:
        raise CacheError(
            f"tilec: cached kernel file {path} does not match the hash in its name "
            "(changed after it was written); it was not executed"
        )
    source = data.decode()
    filename = str(path)
    # mtime None: linecache keeps this entry even if the file changes, so
    # Triton (inspect.getsourcelines) compiles exactly the checked source.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    if interpret:
        interpreter_reduce.install()
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    sys.modules[name] = module
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module
