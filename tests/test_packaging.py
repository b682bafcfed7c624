"""The published dependency bounds that the README's test command relies on."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _extra(name: str) -> dict[str, Requirement]:
    reqs = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"][name]
    return {r.name: r for r in map(Requirement, reqs)}


def test_the_test_extra_keeps_pytest_below_9_2():
    # pytest 9.2 breaks schemathesis (in the same extra): `pip install -e '.[test]'` must not pick it.
    spec = _extra("test")["pytest"].specifier
    assert "9.1.5" in spec and "9.0.3" in spec and "8.4.0" in spec
    assert "9.2.0" not in spec and "9.2.1" not in spec and "10.0" not in spec


def test_the_console_script_names_a_callable():
    import importlib

    target = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]["ttsserve"]
    module, _, attr = target.partition(":")
    assert target == "ttsserve.entrypoints.cli:main" and callable(getattr(importlib.import_module(module), attr))
