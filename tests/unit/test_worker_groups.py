"""Which tests share a pytest-xdist worker (tests/conftest.py ``worker_group``)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import worker_group
from tests.multirank.launch_groups import GROUPS

LAUNCHES = {f"tests/multirank/{m.test}": name for name, members in GROUPS.items() for m in members}


def _item(nodeid: str, *scopes: str) -> SimpleNamespace:
    defs = {f"fixture{k}": [SimpleNamespace(scope=scope)] for k, scope in enumerate(scopes)}
    return SimpleNamespace(nodeid=nodeid, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


def test_the_members_of_one_grouped_launch_share_a_worker() -> None:
    for name, members in GROUPS.items():
        groups = {worker_group(_item(f"tests/multirank/{m.test}", "function"), LAUNCHES) for m in members}
        assert groups == {name}


def test_users_of_a_module_fixture_share_their_file_and_the_rest_go_anywhere() -> None:
    node = "tests/runtime/test_x.py::test_a"
    assert worker_group(_item(node, "function", "module"), LAUNCHES) == "tests/runtime/test_x.py"
    assert worker_group(_item(node, "class"), LAUNCHES) == "tests/runtime/test_x.py"
    assert worker_group(_item(node, "function", "session"), LAUNCHES) is None
    assert worker_group(SimpleNamespace(nodeid=node), LAUNCHES) is None  # e.g. a doctest item


def test_without_launch_groups_a_member_is_scheduled_alone() -> None:
    member = next(iter(GROUPS.values()))[0]
    assert worker_group(_item(f"tests/multirank/{member.test}", "function"), {}) is None
