"""The runtime does not run the split backward yet: a ``zb`` plan is refused before any step."""

from __future__ import annotations

import pytest

from graph_exec.errors import GraphExecError
from graph_exec.runtime.driver import RankRuntime
from graph_exec.schedule import PlanConfig, build_plan


def test_a_zb_plan_is_refused_before_anything_runs() -> None:
    plan = build_plan(PlanConfig(pp=2, micro=4, body="zb"))
    with pytest.raises(
        GraphExecError, match=r"rank 1: the runtime does not run the split backward of body 'zb'"
    ):
        RankRuntime(plan, 1, executor=None, transport=None, buffers=None)
