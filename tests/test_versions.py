"""Supported torch/triton pairs, and an install that never replaces them."""

import importlib.metadata
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tilec import versions

ROOT = Path(__file__).resolve().parent.parent


def test_tested_pairs_are_accepted():
    assert versions.untested("2.11.0+cu128", "3.6.0") is None
    assert versions.untested("2.13.0+cpu", "3.7.1") is None
    assert versions.untested("2.14.1", "3.8.0") is None


def test_untested_pairs_say_why():
    assert "pins triton 3.7" in versions.untested("2.13.0", "3.8.0")
    assert "this is torch 2.10.0" in versions.untested("2.10.0", "3.5.0")
    assert "this is torch 2.15.0" in versions.untested("2.15.0", "3.9.0")


def test_the_installed_pair_is_checked_at_import(monkeypatch):
    fake = {"torch": "2.13.0", "triton": "3.8.0"}
    monkeypatch.setattr(importlib.metadata, "version", fake.__getitem__)
    with pytest.warns(UserWarning, match="but triton 3.8.0 is installed"):
        versions.check_installed()
    fake["triton"] = "3.7.1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_installed()


def test_dependencies_have_no_upper_bound():
    """An upper bound on torch or triton makes pip replace a newer one the user
    already has (torch 2.14.1 pins triton 3.8.0: `triton<3.8` downgraded both)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {r.name: r for r in map(Requirement, project["dependencies"])}
    for name in ("torch", "triton"):
        for spec in requirements[name].specifier:
            assert spec.operator in (">=", ">"), f"{name}{spec} could replace a user's {name}"
        assert requirements[name].specifier.contains("99.0")
    lowest = {
        name: min(spec.version for spec in requirements[name].specifier)
        for name in requirements
        if name in ("torch", "triton")
    }
    oldest_torch = min(versions.TESTED)
    assert lowest["torch"] == "{}.{}".format(*oldest_torch)
    assert lowest["triton"] == "{}.{}".format(*versions.TESTED[oldest_torch])
