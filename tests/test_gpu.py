"""GPU tier: tests that need CUDA carry the ``gpu`` mark and are skipped without it
(``python -m pytest -m gpu`` runs just them on a GPU machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_demo_models_match_eager_on_cuda(tmp_path):
    """The README's first command on a GPU: both demo models compiled for CUDA
    (Triton compiles the kernels for the device) match eager."""
    run = subprocess.run(
        [sys.executable, str(DEMO), "--device", "cuda", "--dump", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("matches eager") == 2, run.stdout
    assert "compiled by Triton" in run.stdout
    assert "interpreter" not in run.stdout
