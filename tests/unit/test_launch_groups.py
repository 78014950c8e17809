"""The multi-rank launch groups (tests/multirank/launch_groups.py): every member names a test that
exists, no suite is in two groups, and a grouped launch's log is cut into each member's section."""

from __future__ import annotations

import ast
from pathlib import Path

from graph_exec.launch import LaunchResult
from tests.multirank.launch_groups import GROUPS, Member, find, section

MULTIRANK = Path(__file__).resolve().parents[1] / "multirank"


def test_every_member_names_an_existing_test_and_worker() -> None:
    for members in GROUPS.values():
        for member in members:
            path, test = member.test.split("::")
            tree = ast.parse((MULTIRANK / path).read_text())
            names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
            assert test.split("[")[0] in names, member.test
            assert (MULTIRANK / "workers" / member.script).is_file(), member.script


def test_no_suite_or_test_is_in_two_groups_and_each_group_has_one_world_size() -> None:
    members = [m for group in GROUPS.values() for m in group]
    assert len({m.test for m in members}) == len(members)
    assert len({(m.name, m.device_path) for m in members}) == len(members)
    for group in GROUPS.values():
        assert len({(m.nproc, m.device_path) for m in group}) == 1
    first = next(iter(GROUPS.values()))[0]
    assert find(first.script, first.nproc, first.args, first.device_path)[1] == first
    assert find(first.script, first.nproc + 1, first.args, first.device_path) is None


def _result(logs: dict[int, str], returncode: int = 0, timed_out: bool = False) -> LaunchResult:
    return LaunchResult(returncode, timed_out, 1.0, Path("."), "", logs)


A = Member("t.py::a", "a.py", 2, ("s",), False, 10)
B = Member("t.py::b", "b.py", 2, (), False, 10)


def test_each_member_gets_its_own_section_and_status() -> None:
    log = "MEMBER a.py:s BEGIN\nCHECK x OK\nALL DONE failures=0\nMEMBER a.py:s END rc=0\nMEMBER b.py BEGIN\nCHECK y FAIL z\nMEMBER b.py END rc=1\n"
    result = _result({0: log, 1: log}, returncode=1)
    cut, missing = section(result, A)
    assert not missing and cut.returncode == 0 and cut.worker_logs[0] == "CHECK x OK\nALL DONE failures=0\n"
    cut, missing = section(result, B)
    assert not missing and cut.returncode == 1 and cut.worker_logs[1] == "CHECK y FAIL z\n"


def test_a_member_that_never_began_or_ended_is_reported() -> None:
    log = "MEMBER a.py:s BEGIN\nCHECK x OK\nTraceback\n"
    result = _result({0: log, 1: log}, returncode=1, timed_out=True)
    cut, missing = section(result, A)
    assert not missing and cut.timed_out and cut.worker_logs[0] == "CHECK x OK\nTraceback\n"
    cut, missing = section(result, B)
    assert len(missing) == 2 and "never began b.py" in missing[0] and cut.returncode == 1
