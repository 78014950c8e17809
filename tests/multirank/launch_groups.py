"""Which multi-rank suites share one msrun launch, and how a grouped launch's logs are split.

Every msrun launch pays seconds of start-up and its own compilations (issue 50: about 10 s a
launch before any check runs). Suites of the same worker family that need the same number of
ranks and the same environment run in one launch of ``workers/grouped.py``, one after another;
each test still calls ``run_workers(script, nproc, suite, ...)`` as before and gets a
:class:`~graph_exec.launch.LaunchResult` whose worker logs are its own member's section, so its
assertions are unchanged. Only the members whose tests were collected run: ``pytest -k`` on one
test launches that test's suite alone, as a launch of its own.

Order inside a group: a suite whose last check makes a rank fail on purpose leaves messages in
flight that nobody receives (``training_loop_checks p2``/``p4`` end with a loss that raises on the
last stage, after rank 0 sent it activations; ``mesh_checks all`` with a set-up failure); the next
member's first collective would receive them. So such a suite runs last in its group, and suites
that are nothing but such checks (``gate``, ``gate_mesh``) and ``training_loop_checks p4`` (the p4
group ends with ``mesh_checks all``) keep a launch of their own.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from graph_exec.launch import LaunchResult


@dataclass(frozen=True)
class Member:
    """One suite of a grouped launch: the test that asks for it and what it would launch alone."""

    test: (
        str  # node id below tests/multirank/, e.g. "test_pipeline.py::test_pipeline_matches_reference[p2-2]"
    )
    script: str
    nproc: int
    args: tuple[str, ...]
    device_path: bool
    timeout_s: float  # the test's own launch limit; a group's limit is the sum over its members

    @property
    def name(self) -> str:
        """The driver's argument (and marker name) for this member: ``script:arg:...``."""
        return ":".join((self.script, *self.args))


def _member(
    test: str, script: str, nproc: int, suite: str | None, timeout_s: float, device: bool = False
) -> Member:
    return Member(test, script, nproc, () if suite is None else (suite,), device, timeout_s)


_PIPE, _BASE, _LOOP, _MESH = (
    "pipeline_checks.py",
    "baseline_checks.py",
    "training_loop_checks.py",
    "mesh_checks.py",
)
_TRAIN = "test_training_loop.py::test_training_loop_matches_the_reference"
_DEVICE = "test_device_path.py::test_"

GROUPS: dict[str, list[Member]] = {
    "p2": [
        _member("test_pipeline.py::test_pipeline_matches_reference[p2-2]", _PIPE, 2, "p2", 900),
        _member(
            "test_backward_options.py::test_backward_options_match_reference_in_both_modes",
            _PIPE,
            2,
            "backward_options",
            900,
        ),
        _member("test_zero_bubble.py::test_zero_bubble_matches_reference[2]", _PIPE, 2, "zb_p2", 900),
        _member("test_fair_baseline.py::test_fair_baseline_matches_reference[p2-2]", _BASE, 2, "p2", 900),
        _member(f"{_TRAIN}[p2-2]", _LOOP, 2, "p2", 360),
    ],
    "p4": [
        _member("test_pipeline.py::test_pipeline_matches_reference[p4-4]", _PIPE, 4, "p4", 900),
        _member("test_zero_bubble.py::test_zero_bubble_matches_reference[4]", _PIPE, 4, "zb_p4", 900),
        _member("test_fair_baseline.py::test_fair_baseline_matches_reference[p4-4]", _BASE, 4, "p4", 900),
        _member(f"{_TRAIN}[mesh-4]", _LOOP, 4, "mesh", 360),
        _member(
            "test_zero_bubble.py::test_zero_bubble_on_a_dp2_pp2_mesh_matches_reference",
            _MESH,
            4,
            "zb_dp2pp2",
            900,
        ),
        _member("test_mesh.py::test_optimizer_sharding_matches_the_unsharded_run", _MESH, 4, "zero", 600),
        _member(
            "test_mesh.py::test_data_parallel_pipelines_match_the_global_batch_reference",
            _MESH,
            4,
            "all",
            900,
        ),
    ],
    # the mindone models and the shape options at 2 ranks: mindone's import is paid once
    "models_p2": [
        _member(
            "test_mindone_models.py::test_split_mindone_models_match_the_whole_model",
            "mindone_checks.py",
            2,
            None,
            540,
        ),
        _member(
            "test_vlm_batch.py::test_vlm_batches_match_the_whole_model_on_each_unpadded_sample",
            "vlm_batch_checks.py",
            2,
            None,
            840,
        ),
        _member(
            "test_vlm_batch.py::test_packed_rows_match_the_whole_model_on_each_sample_at_two_ranks",
            "vlm_batch_checks.py",
            2,
            "packed",
            240,
        ),
        _member(
            "test_tower_order.py::test_balanced_placement_matches_reference_at_two_ranks",
            "tower_order_checks.py",
            2,
            None,
            600,
        ),
        _member(
            "test_shapes.py::test_bucketed_runs_match_the_reference_on_the_unpadded_batch",
            "shape_checks.py",
            2,
            None,
            240,
        ),
        _member(
            "test_owned_data.py::test_owned_reading_with_balanced_placement_matches_replicated_input",
            "owned_data_checks.py",
            2,
            None,
            600,
        ),  # ends with a failing case: last
    ],
    "device_p2": [
        _member(
            f"{_DEVICE}pipeline_matches_reference_on_the_device_path[device_p2-2]",
            _PIPE,
            2,
            "device_p2",
            900,
            device=True,
        ),
        _member(
            f"{_DEVICE}fair_baseline_matches_reference_on_the_device_path", _BASE, 2, "p2", 900, device=True
        ),
        _member(
            f"{_DEVICE}low_precision_chunks_match_the_reference_on_the_device_path",
            _LOOP,
            2,
            "device_low_precision",
            360,
            device=True,
        ),
    ],
    "device_p4": [
        _member(
            f"{_DEVICE}pipeline_matches_reference_on_the_device_path[device_p4-4]",
            _PIPE,
            4,
            "device_p4",
            900,
            device=True,
        ),
        _member(
            f"{_DEVICE}data_parallel_pipelines_match_the_reference_on_the_device_path",
            _MESH,
            4,
            "all",
            900,
            device=True,
        ),
    ],
}


def find(script: str, nproc: int, args: tuple[str, ...], device_path: bool) -> tuple[str, Member] | None:
    """The group and member a launch request belongs to, if any."""
    for group, members in GROUPS.items():
        for member in members:
            if (member.script, member.nproc, member.args, member.device_path) == (
                script,
                nproc,
                args,
                device_path,
            ):
                return group, member
    return None


def _between(log: str, member: str) -> tuple[str | None, int | None]:
    """``member``'s section of one rank's log (``None``: it never began) and its exit status
    (``None``: it never ended: the rank crashed or the launch timed out inside it)."""
    begin = re.search(rf"^MEMBER {re.escape(member)} BEGIN$", log, re.MULTILINE)
    if begin is None:
        return None, None
    end = re.compile(rf"^MEMBER {re.escape(member)} END rc=(-?\d+)$", re.MULTILINE).search(log, begin.end())
    if end is None:
        return log[begin.end() :].lstrip("\n"), None
    return log[begin.end() : end.start()].lstrip("\n"), int(end.group(1))


def section(result: LaunchResult, member: Member) -> tuple[LaunchResult, list[str]]:
    """The launch as ``member``'s test sees it: every rank's log cut to ``member``'s section, the
    exit status its ranks reported (a member that finished on every rank did not time out, even
    if the launch did later), and what kept it from running or finishing on some rank."""
    logs, statuses, missing = {}, [], []
    for rank in range(member.nproc):
        text, status = _between(result.worker_logs.get(rank, ""), member.name)
        if text is None:
            missing.append(
                f"rank {rank} never began {member.name}: an earlier member of the launch stopped it"
            )
            text = result.worker_logs.get(rank, "")
        logs[rank] = text
        statuses.append(status)
    finished = all(status is not None for status in statuses)
    returncode = max(statuses) if finished else (result.returncode or 1)
    cut = dataclasses.replace(
        result,
        worker_logs=logs,
        returncode=returncode,
        timed_out=result.timed_out and not finished,
    )
    return cut, missing
