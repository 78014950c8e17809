"""Which tests share a pytest-xdist worker (tests/conftest.py ``worker_scope``)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import launch_groups, worker_scope
from tests.multirank.launch_groups import GROUPS


def test_the_members_of_one_grouped_launch_share_a_worker() -> None:
    groups = launch_groups()
    for name, members in GROUPS.items():
        assert {worker_scope(f"tests/multirank/{m.test}", groups) for m in members} == {name}


def test_any_other_test_shares_its_file_with_the_tests_beside_it() -> None:
    groups = launch_groups()
    assert worker_scope("tests/runtime/test_x.py::test_a[graph]", groups) == "tests/runtime/test_x.py"
    assert worker_scope("tests/unit/test_y.py::TestZ::test_b", groups) == "tests/unit/test_y.py"


def test_without_launch_groups_a_member_shares_only_its_file(monkeypatch) -> None:
    monkeypatch.setenv("GRAPH_EXEC_TEST_GROUPS", "0")
    member = next(iter(GROUPS.values()))[0]
    node = f"tests/multirank/{member.test}"
    assert worker_scope(node, launch_groups()) == node.split("::")[0]


def test_a_backend_wait_limit_set_in_a_test_is_set_there():
    """The first half of the leak check below: a transport's limit lands in ``os.environ``."""
    from graph_exec.transport import bound_backend_waits
    from graph_exec.transport.cpu_workarounds import BACKEND_TIMEOUT_ENV

    if BACKEND_TIMEOUT_ENV in os.environ:
        pytest.skip(f"{BACKEND_TIMEOUT_ENV} is set in the environment the tests run in")
    bound_backend_waits(7.0)
    assert os.environ[BACKEND_TIMEOUT_ENV] == "7"


def test_and_is_gone_for_the_next_test():
    """tests/conftest.py undid it: jobs this process launches next get their own limits."""
    from graph_exec.transport.cpu_workarounds import BACKEND_TIMEOUT_ENV

    assert os.environ.get(BACKEND_TIMEOUT_ENV) != "7"
