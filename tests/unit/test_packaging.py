"""Every package of the library is listed in pyproject.toml: a non-editable install (a wheel)
ships only the listed ones, so a package missing there imports in a clone and fails installed."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages_on_disk() -> set[str]:
    found = {"graph_exec.kernels", "graph_exec.examples"}  # installed from kernels/, examples/
    for init in (ROOT / "graph_exec").rglob("__init__.py"):
        if "__pycache__" not in init.parts and not init.parent.is_symlink():
            found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_every_package_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = _packages_on_disk()
    assert on_disk - listed == set(), f"packages not in pyproject.toml: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"listed but absent: {sorted(listed - on_disk)}"
