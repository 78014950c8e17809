"""What CI must keep true besides the tests themselves: the multi-rank tests are collected by the
plain ``pytest`` command (a folder named ``dist`` once hid them all), and the code is lint- and
format-clean. Each check runs the tool as a subprocess, the way CI and a developer run it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MULTIRANK = ROOT / "tests" / "multirank"
ENV = {**os.environ, "GLOG_v": "3"}


def defined_tests(path: Path) -> set[str]:
    """Names of the module-level ``test_*`` functions in ``path``."""
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }


def test_every_multirank_test_is_collected_and_marked_dist() -> None:
    """Collect from the repository root like the README's command, keeping only ``-m dist``."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "dist", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        if "::" in line:
            path, name = line.split("::", 1)
            collected.setdefault(path, set()).add(name.split("[", 1)[0])
    files = sorted(MULTIRANK.glob("test_*.py"))
    assert len(files) >= 4, files  # transport, pipeline, failures, harness at least
    expected = {str(f.relative_to(ROOT)): defined_tests(f) for f in files}
    assert collected == expected, proc.stdout


def test_ruff_check_is_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
