"""The Plan object's public API: geometry, ownership, peers, lazily made Step orders."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from graph_exec.schedule import (
    IDLE,
    Plan,
    PlanConfig,
    PlanConfigError,
    PlanTooLargeError,
    Step,
    StepKind,
    build_plan,
    check_plan_size,
    codes,
    estimate_steps,
    size,
)

K = StepKind


def test_geometry() -> None:
    plan = build_plan(PlanConfig(pp=4, vpp=3, micro=8))
    assert (plan.num_stages, plan.last_stage) == (12, 11)
    assert [plan.stage_rank(s) for s in range(12)] == [0, 1, 2, 3] * 3
    assert isinstance(plan.orders, tuple) and all(isinstance(row, tuple) for row in plan.orders)
    assert all(isinstance(step, Step) for row in plan.orders for step in row)
    assert plan.order(2) is plan.orders[2]  # made once


def test_ownership_full_and_min() -> None:
    full = build_plan(PlanConfig(pp=3, micro=7, preprocess="frozen"))
    assert [full.owner(m) for m in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [full.owned(r) for r in range(3)] == [(0, 3, 6), (1, 4), (2, 5)]
    least = build_plan(PlanConfig(pp=3, micro=7, preprocess="frozen", run_ahead="min"))
    assert [least.owner(m) for m in range(7)] == [0, 1, 2, 0, 0, 0, 0]
    assert [least.owned(r) for r in range(3)] == [(0, 3, 4, 5, 6), (1,), (2,)]
    few = build_plan(PlanConfig(pp=4, micro=2, preprocess="frozen"))
    assert [few.owned(r) for r in range(4)] == [(0,), (1,), (), ()]  # ranks >= NT own nothing


def test_peers() -> None:
    plan = build_plan(PlanConfig(pp=3, vpp=2, micro=4, preprocess="trainable", backward="owner"))
    cases = {
        (0, "Fsend0.1"): 1,
        (1, "Frecv1.1"): 0,
        (2, "Fsend2.1"): 0,  # stage 3 wraps around to rank 0
        (0, "Frecv3.1"): 2,
        (0, "Bsend3.0"): 2,
        (2, "Brecv2.0"): 0,
        (1, "OUTsend1"): 0,
        (0, "OUTrecv2"): 2,
        (0, "GRADsend1"): 1,
        (1, "GRADrecv+bwd1"): 0,
        (0, "F0.0"): None,
        (2, "BCAST"): None,
        (1, "TFWD1"): None,
    }
    for (rank, token), peer in cases.items():
        assert plan.peer(rank, Step.parse(token)) == peer, token


def test_peer_of_a_step_the_rank_does_not_run() -> None:
    plan = build_plan(PlanConfig(pp=2, micro=4, preprocess="frozen"))
    with pytest.raises(ValueError, match=r"F1\.0 runs on rank 1, not on rank 0"):
        plan.peer(0, Step.parse("F1.0"))
    with pytest.raises(ValueError, match=r"OUTrecv1 runs on rank 0, not on rank 1"):
        plan.peer(1, Step.parse("OUTrecv1"))
    with pytest.raises(ValueError, match="outside this plan"):
        plan.peer(0, Step.parse("F0.9"))


def test_with_idle_keeps_idle_slots_that_orders_drop() -> None:
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=4, preprocess="trainable"))
    assert IDLE in plan.with_idle[0]
    for with_idle, order in zip(plan.with_idle, plan.orders, strict=True):
        assert tuple(s for s in with_idle if s != IDLE) == order
    assert plan.with_idle_codes[0] == tuple(map(codes.encode_step, plan.with_idle[0]))


def test_picture_codes_is_a_deprecated_alias_of_with_idle_codes() -> None:
    plan = build_plan(PlanConfig(pp=2, micro=3, preprocess="frozen"))
    with pytest.warns(DeprecationWarning, match="use Plan.with_idle_codes"):
        assert plan.picture_codes == plan.with_idle_codes
    assert plan.body == tuple(
        tuple(s for s in row if s.kind not in {K.BCAST, K.TFWD, K.OUTRECV, K.OUTSEND, K.TBWD})
        for row in plan.orders
    )


def test_step_parse_round_trips_every_kind() -> None:
    for token in [
        "F0.1",
        "B12.3",
        "Fsend0.1",
        "Frecv1.0",
        "Bsend2.2",
        "Brecv0.0",
        "BCAST",
        "TFWD3",
        "OUTsend1",
        "OUTrecv1",
        "INsend1",
        "INrecv1",
        "TBWD0",
        "GRADsend1",
        "GRADrecv+bwd2",
        "GRADreduce",
        "·",
    ]:
        assert Step.parse(token).token == token
    for bad in ["F0", "TFWD", "BCAST1", "X1", "F1.2.3", ""]:
        with pytest.raises(ValueError, match="not a step token"):
            Step.parse(bad)


def test_from_tokens_needs_one_row_per_rank() -> None:
    with pytest.raises(ValueError, match=r"one row per rank \(2\), got 1"):
        Plan.from_tokens(PlanConfig(pp=2), [["F0.0"]])


def test_schedule_and_simulator_import_without_mindspore() -> None:
    code = (
        "import sys; sys.modules['mindspore'] = None\n"
        "import graph_exec.schedule, graph_exec.simulate, graph_exec.cli.plan, graph_exec.cli.simulate\n"
        "from graph_exec.cli import main\n"
        "assert main(['plan', '--pp', '2', '--vpp', '1', '--micro', '2', '--preprocess', 'trainable']) == 0\n"
        "assert main(['simulate', '--pp', '2', '--vpp', '2', '--micro', '4', '--preprocess', 'frozen']) == 0\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("r0: BCAST TFWD0 OUTrecv1")


@pytest.mark.parametrize(
    "config",
    [
        PlanConfig(pp=1, vpp=1, micro=7, preprocess="trainable"),
        PlanConfig(pp=2, vpp=1, micro=9, preprocess="trainable", backward="owner", input="owned"),
        PlanConfig(pp=4, vpp=2, micro=11, preprocess="trainable", input="owned", run_ahead="min"),
        PlanConfig(pp=4, vpp=3, micro=8, preprocess="trainable", backward="owner"),
        PlanConfig(pp=3, vpp=2, micro=5, preprocess="frozen", input="owned", body="gpipe"),
        PlanConfig(pp=8, vpp=1, micro=16, body="1f1b"),
        PlanConfig(pp=4, vpp=2, micro=6, preprocess="trainable", transpose=False),
        PlanConfig(pp=4, vpp=2, micro=6, preprocess="trainable", forward_only=True),
    ],
)
def test_the_size_estimate_bounds_the_built_plan(config: PlanConfig) -> None:
    plan = build_plan(config)
    built = sum(map(len, plan.order_codes))
    assert built <= estimate_steps(config) <= 2.5 * built + 4 * config.pp


def test_a_plan_too_large_is_refused_by_formula_before_anything_is_built() -> None:
    # Issue 39.3: --micro 100000000 ran 147 s and took all 24 GB before the OOM killer fired.
    start = time.perf_counter()
    with pytest.raises(
        PlanTooLargeError, match=r"pp=2, vpp=1, micro=100000000: building the plan would take"
    ) as err:
        build_plan(PlanConfig(pp=2, vpp=1, micro=100_000_000, preprocess="trainable"))
    assert time.perf_counter() - start < 0.5
    assert f"the limit is {size.MAX_PLAN_STEPS:,} steps" in str(err.value)
    assert isinstance(err.value, PlanConfigError) and isinstance(err.value, ValueError)


def test_the_advised_micro_batch_count_fits() -> None:
    with pytest.raises(PlanTooLargeError, match=r"about ([\d,]+) at most") as err:
        check_plan_size(PlanConfig(pp=4, vpp=2, micro=10**7))
    fits = int(re.search(r"about ([\d,]+) at most", str(err.value)).group(1).replace(",", ""))
    assert check_plan_size(PlanConfig(pp=4, vpp=2, micro=fits)) <= size.MAX_PLAN_STEPS
    with pytest.raises(PlanTooLargeError):
        check_plan_size(PlanConfig(pp=4, vpp=2, micro=fits + 1))


def test_the_memory_limit_is_a_fraction_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    config = PlanConfig(pp=2, vpp=1, micro=1000)  # 20,008 steps estimated
    assert check_plan_size(config) == estimate_steps(config) == 20_008
    monkeypatch.setattr(size, "physical_memory_bytes", lambda: 2 * 20_008 * size.BUILD_BYTES_PER_STEP)
    with pytest.raises(PlanTooLargeError, match=r"25% of this machine's memory is .* GiB"):
        build_plan(config)
    monkeypatch.setattr(size, "physical_memory_bytes", lambda: 4 * 20_008 * size.BUILD_BYTES_PER_STEP)
    assert len(build_plan(config).order_codes) == 2
