"""The kernel cache is a trust boundary: what it executes, where it writes.

Each test points ``TILEC_CACHE_DIR`` at its own folder.  Unwritable locations
are made real: when the suite runs as root (who may write anywhere) a forked
child drops to the ``nobody`` user before it looks at the cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tilec.codegen import cache

NOBODY = 65534
ROOT = os.geteuid() == 0

SOURCE = textwrap.dedent(
    """
    import triton
    import triton.language as tl

    @triton.jit
    def tilec_k0(x_ptr, XBLOCK: tl.constexpr):
        pass

    MARKER = 1
    """
)


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV, str(root))
    return root


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --- what is executed -------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda s: s.replace("MARKER = 1", "MARKER = 2"), id="edited"),
        pytest.param(lambda s: s[: len(s) // 2], id="truncated"),
        pytest.param(lambda s: s + "\ndef broken(:\n", id="syntax_error"),
        pytest.param(lambda s: "", id="empty"),
    ],
)
def test_a_damaged_file_is_replaced_with_a_warning(cache_root, caplog, damage):
    path = cache.write_source(SOURCE)
    path.write_text(damage(SOURCE))
    with caplog.at_level(logging.WARNING, logger="tilec.cache"):
        assert cache.write_source(SOURCE) == path
    (message,) = _warnings(caplog)
    assert str(path) in message and "differs from the generated source" in message
    assert path.read_text() == SOURCE
    assert cache.load_module(path, interpret=True).MARKER == 1


def test_an_intact_file_is_kept_silently(cache_root, caplog):
    path = cache.write_source(SOURCE)
    mtime = path.stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="tilec.cache"):
        assert cache.write_source(SOURCE) == path
    assert not _warnings(caplog)
    assert path.stat().st_mtime_ns == mtime
    assert _mode(path) == 0o600


def test_a_file_writable_by_others_is_replaced(cache_root, caplog):
    path = cache.write_source(SOURCE)
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="tilec.cache"):
        cache.write_source(SOURCE)
    (message,) = _warnings(caplog)
    assert str(path) in message and "writable by other users" in message
    assert _mode(path) == 0o600


def test_a_link_in_place_of_a_file_is_replaced(cache_root, tmp_path, caplog):
    path = cache.write_source(SOURCE)
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text(SOURCE)
    path.unlink()
    path.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="tilec.cache"):
        cache.write_source(SOURCE)
    assert "not a regular file" in _warnings(caplog)[0]
    assert not path.is_symlink() and path.read_text() == SOURCE


def test_a_file_changed_after_writing_is_never_executed(cache_root, tmp_path):
    """``load_module`` checks the bytes it executes against the hash in the name."""
    path = cache.write_source(SOURCE.replace("MARKER = 1", "MARKER = 3"))
    ran = tmp_path / "ran"
    path.write_text(f"open({str(ran)!r}, 'w').close()\n")
    with pytest.raises(cache.CacheError, match="does not match the hash in its name") as err:
        cache.load_module(path, interpret=True)
    assert str(path) in str(err.value)
    assert not ran.exists()


# A module that rewrites its own file while it is imported, before Triton reads
# the kernel's source: the window between the check and Triton's read.
SELF_EDITING = textwrap.dedent(
    """
    import triton
    import triton.language as tl

    with open(__file__) as f:
        text = f.read()
    with open(__file__, "w") as f:
        f.write(text.replace("pa" + "ss  # body", "tl.store(x_ptr, 1.0)"))

    @triton.jit
    def tilec_k0(x_ptr, XBLOCK: tl.constexpr):
        pass  # body
    """
)


def test_triton_compiles_the_checked_source_not_the_file(cache_root):
    """Triton reads a kernel's source through inspect; it must see the bytes that
    were checked and executed, even when the file changes in between."""
    path = cache.write_source(SELF_EDITING)
    module = cache.load_module(path, interpret=False)
    assert "tl.store" in path.read_text()  # the file did change ...
    assert "pass  # body" in module.tilec_k0.src  # ... but not what Triton compiles
    assert "tl.store" not in module.tilec_k0.src


TAMPER_SCRIPT = """
import logging, sys, torch, tilec
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU()).eval()
x = torch.randn(4, 8)
with torch.no_grad():
    print((torch.compile(m, backend="tilec")(x) - m(x)).abs().max().item())
"""


def test_a_tampered_kernel_is_regenerated_in_a_new_process(cache_root, tmp_path):
    """The reported reproduction: edit a cached GELU kernel (``* 0.5`` ->
    ``* 0.25``, plus code that would run at import) and compile again in a
    fresh process: the answer stays right and the file is named."""

    def compile_in_new_process() -> subprocess.CompletedProcess:
        run = subprocess.run(
            [sys.executable, "-c", TAMPER_SCRIPT], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr
        return run

    first = compile_in_new_process()
    assert float(first.stdout) < 1e-5
    (path,) = [p for p in (cache_root / "kernels").glob("k_*.py") if "* 0.5)" in p.read_text()]
    ran = tmp_path / "ran"
    tampered = f"open({str(ran)!r}, 'w').close()\n" + path.read_text().replace("* 0.5)", "* 0.25)")
    path.write_text(tampered)
    second = compile_in_new_process()
    assert float(second.stdout) < 1e-5
    assert f"replaced cached kernel file {path}" in second.stderr
    assert not ran.exists()
    assert "* 0.5)" in path.read_text()


# --- where it writes --------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "created"),
    [
        pytest.param({cache.ENV: "a/b"}, ("a", "a/b", "a/b/kernels"), id="TILEC_CACHE_DIR"),
        pytest.param(
            {cache.ENV: None, "XDG_CACHE_HOME": "xdg"},
            ("xdg", "xdg/tilec", "xdg/tilec/kernels"),
            id="default",
        ),
    ],
)
def test_folders_are_private_whatever_the_umask(tmp_path, monkeypatch, variables, created):
    for var, value in variables.items():
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(tmp_path / value))
    previous = os.umask(0)
    try:
        path = cache.write_source(SOURCE)
    finally:
        os.umask(previous)
    assert path.parent == tmp_path / created[-1]
    for folder in created:
        assert _mode(tmp_path / folder) == 0o700, folder
    assert _mode(path) == 0o600


def _refused(root: Path, caplog, why: str) -> None:
    with caplog.at_level(logging.WARNING, logger="tilec.cache"):
        path = cache.write_source(SOURCE)
    assert root not in path.parents
    assert path.read_text() == SOURCE
    assert _mode(path.parent) == 0o700
    (message,) = _warnings(caplog)
    assert why in message and cache.ENV in message


def test_a_world_writable_cache_folder_is_refused(cache_root, caplog):
    cache_root.mkdir(mode=0o700)
    cache_root.chmod(0o777)
    _refused(cache_root, caplog, "writable by other users")


@pytest.mark.parametrize("folder", cache.FOLDERS)
def test_a_group_writable_subfolder_is_refused(cache_root, caplog, folder):
    """The kernels' folder, and the autotuning results' beside it: the whole
    root falls back, with one warning."""
    (cache_root / folder).mkdir(parents=True)
    cache_root.chmod(0o700)
    (cache_root / folder).chmod(0o770)
    _refused(cache_root, caplog, "writable by other users")
    assert cache.cache_dir("autotune").parent == cache.cache_dir().parent


@pytest.mark.skipif(not ROOT, reason="giving a folder to another user needs root")
def test_a_cache_folder_owned_by_another_user_is_refused(cache_root, caplog):
    cache_root.mkdir(mode=0o700)
    os.chown(cache_root, NOBODY, NOBODY)
    _refused(cache_root, caplog, f"owned by uid {NOBODY}")


def test_a_file_in_the_way_falls_back(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cache.ENV, str(blocker / "cache"))
    _refused(blocker, caplog, "Not a directory")


def test_a_compile_with_an_unusable_cache_works_and_warns_once(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cache.ENV, str(blocker))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="tilec.cache"):
        out = torch.compile(model, backend="tilec")(x)
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    (message,) = _warnings(caplog)
    assert f"kernel cache {blocker}" in message and "not a folder" in message


def test_a_cache_folder_deleted_while_running_is_made_again(cache_root):
    cache.write_source(SOURCE)
    shutil.rmtree(cache_root)
    path = cache.write_source(SOURCE.replace("MARKER = 1", "MARKER = 5"))
    assert path.parent == cache_root / "kernels" and path.exists()


def _as_another_user(check: Callable[[], object]) -> dict:
    """Run ``check`` in a forked child that cannot write where this user can:
    as root the child becomes ``nobody``.  Returns ``check``'s result (JSON)
    and the warnings the child logged."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's atexit
        status = 1
        try:
            os.close(read)
            if ROOT:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            # The parent's checked folders (and its fallback) are not the child's.
            cache._checked_root.cache_clear()
            cache._fallback_dir.cache_clear()
            records: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda r: records.append(r.getMessage())
            logging.getLogger("tilec.cache").addHandler(handler)
            result = check()
            if cache._fallback_dir.cache_info().currsize:
                shutil.rmtree(cache._fallback_dir())
            os.write(write, json.dumps({"result": result, "warnings": records}).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as f:
        report = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and report, "the child failed"
    return json.loads(report)


def _give_away(*paths: Path) -> None:
    """Make ``paths`` belong to whoever :func:`_as_another_user` runs as."""
    for path in paths:
        if ROOT:
            os.chown(path, NOBODY, NOBODY)


def _cache_dir_in_child() -> str:
    return str(cache.write_source(SOURCE).parent)


@pytest.fixture
def shared_tmp(monkeypatch) -> Iterator[Path]:
    """A temporary folder the other user of :func:`_as_another_user` can reach
    (pytest's are private to this user)."""
    path = Path(tempfile.mkdtemp(prefix="tilec-test-cache-"))
    path.chmod(0o711)
    monkeypatch.setenv(cache.ENV, str(path / "cache"))
    yield path
    shutil.rmtree(path)


def test_an_unwritable_cache_folder_falls_back(shared_tmp):
    cache_root = shared_tmp / "cache"
    cache_root.mkdir(mode=0o500)
    _give_away(cache_root)
    report = _as_another_user(_cache_dir_in_child)
    assert not report["result"].startswith(str(cache_root))
    (message,) = report["warnings"]
    assert "Permission denied" in message and cache.ENV in message


def test_an_unwritable_kernels_folder_falls_back(shared_tmp):
    cache_root = shared_tmp / "cache"
    kernels = cache_root / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    cache_root.chmod(0o700)
    kernels.chmod(0o500)
    _give_away(cache_root, kernels)
    report = _as_another_user(_cache_dir_in_child)
    assert not report["result"].startswith(str(cache_root))
    (message,) = report["warnings"]
    assert str(kernels) in message and "Permission denied" in message


def test_a_read_only_home_falls_back(shared_tmp, monkeypatch):
    home = shared_tmp / "home"
    home.mkdir(mode=0o555)
    _give_away(home)
    monkeypatch.delenv(cache.ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    report = _as_another_user(_cache_dir_in_child)
    assert not report["result"].startswith(str(home))
    (message,) = report["warnings"]
    assert "Permission denied" in message and cache.ENV in message
