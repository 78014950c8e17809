"""Multi-rank test support: one helper launches a worker script under msrun.

Every launch has a wall-clock limit, so a hang fails the test instead of blocking CI, and a
failing launch puts every worker's log tail into the assertion message, so the traceback of
the rank that failed shows up in the test report.

Workers report with lines ``CHECK <name> OK`` or ``CHECK <name> FAIL <detail>``. A FAIL line
on any rank fails the test, whatever else happened; so does a time-out, and a non-zero exit
unless the test expects the job to fail (``expect_ok=False``). Only OK lines count as passed
checks (:func:`checks`), so a test asserts the names it needs and a worker that stopped early
cannot pass by printing nothing.

Suites that need the same ranks and environment share one launch (``launch_groups.py``,
``workers/grouped.py``, docs/testing.md): a test still asks ``run_workers`` for its suite and
gets its own member's section of the shared launch, judged as a launch of its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from graph_exec.device import FAST_PATHS_ENV, DevicePolicy, fast_paths_requested
from graph_exec.launch import LaunchResult, launch
from graph_exec.msenv import HOST_BLOCKING_ENV
from graph_exec.transport.cpu_workarounds import BACKEND_TIMEOUT_ENV
from tests.conftest import GROUPS_ENV
from tests.multirank.launch_groups import GROUPS, Member, find, section
from tests.multirank.workers.grouped import ALL_MEMBERS_DONE

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).resolve().parents[2]

_CHECK = re.compile(r"^CHECK (\S+) (OK|FAIL)\b(.*)$")


#: The members of each launch group (tests/multirank/launch_groups.py) whose tests were collected,
#: for groups with at least two: those run in one launch; and each group's launch, once run.
_SELECTED: dict[str, list[Member]] = {}
_GROUP_RESULTS: dict[str, LaunchResult] = {}


@pytest.hookimpl(tryfirst=True)  # before `-m "not dist"` deselects by it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/multirank is a multi-rank test (a directory named `dist` would be
    skipped by pytest's default norecursedirs)."""
    for item in items:
        if _is_multirank(item):
            item.add_marker(pytest.mark.dist)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Which members of each launch group run, from the tests left after ``-k`` and ``-m``
    (deciding it earlier launched a whole group for one test asked for by ``-k``). Grouped
    tests get their group's time limit: the first of them to run pays for the whole launch."""
    mine = {
        item.nodeid.removeprefix("tests/multirank/"): item for item in session.items if _is_multirank(item)
    }
    _SELECTED.clear()
    if os.environ.get(GROUPS_ENV) == "0":
        return
    for group, members in GROUPS.items():
        selected = [member for member in members if member.test in mine]
        if len(selected) < 2:
            continue
        _SELECTED[group] = selected
        limit = sum(member.timeout_s for member in selected) + 120
        for member in selected:
            mine[member.test].add_marker(pytest.mark.timeout(limit), append=False)


def _is_multirank(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).is_relative_to(Path(__file__).parent)


def _check_lines(result: LaunchResult, rank: int) -> list[tuple[str, str, str]]:
    """(name, OK|FAIL, detail) of every CHECK line rank ``rank`` printed."""
    found = []
    for line in result.worker_logs.get(rank, "").splitlines():
        match = _CHECK.match(line.strip())
        if match:
            found.append((match.group(1), match.group(2), match.group(3).strip()))
    return found


def checks(result: LaunchResult, rank: int) -> set[str]:
    """The names of the ``CHECK <name> OK`` lines rank ``rank`` printed (FAIL lines never count)."""
    return {name for name, verdict, _ in _check_lines(result, rank) if verdict == "OK"}


def failed_checks(result: LaunchResult) -> list[str]:
    """Every ``CHECK <name> FAIL`` line of every rank, as ``rank R: name detail``."""
    return [
        f"rank {rank}: {name} {detail}".rstrip()
        for rank in sorted(result.worker_logs)
        for name, verdict, detail in _check_lines(result, rank)
        if verdict == "FAIL"
    ]


def policy_problems(result: LaunchResult, expected: DevicePolicy, nproc: int) -> list[str]:
    """Ranks whose ``POLICY`` line (see ``tests.models.common.announce_policy``) is not
    ``expected``'s. On the device path (``expected`` has the CPU fast paths off) a rank that
    printed none is one too: such a launch must prove that its workers took that path."""
    want = f"POLICY {expected.describe()}"
    problems = []
    for rank in sorted(set(range(nproc)) | set(result.worker_logs)):
        log = result.worker_logs.get(rank, "")
        lines = [line.strip() for line in log.splitlines() if line.startswith("POLICY ")]
        if not lines:
            if not expected.cpu_fast_paths:
                problems.append(
                    f"rank {rank} printed no POLICY line, so nothing shows it ran with {want!r}: "
                    "a device-path worker must call tests.models.common.announce_policy()"
                )
        elif lines[0] != want:
            problems.append(f"rank {rank} ran with {lines[0]!r}, not {want!r}")
    return problems


def launch_problems(result: LaunchResult, expect_ok: bool = True) -> list[str]:
    """Why a launch fails its test: a time-out, a FAIL line, a non-zero exit (if not expected)."""
    problems = []
    if result.timed_out:
        problems.append(f"the job did not finish within its limit ({result.seconds:.0f} s)")
    elif expect_ok and result.returncode != 0:
        problems.append(f"the job exited with code {result.returncode}")
    problems += [f"FAIL line from {line}" for line in failed_checks(result)]
    return problems


#: A worker's log after MindSpore 2.10's teardown race: every check done and reported, then a
#: segmentation fault in a thread of MindSpore's own while the interpreter exits (seen about once
#: per full suite, on any launch; the crashing thread and the main thread run no Python code).
_DONE = "ALL DONE failures=0"
_SEGFAULT = "Fatal Python error: Segmentation fault"


def crashed_only_at_exit(result: LaunchResult, nproc: int, done: str = _DONE) -> bool:
    """Whether every rank finished all its checks (its last ``done`` line: ``ALL DONE failures=0``,
    or a grouped launch's ``ALL MEMBERS DONE``) and the only trouble is a segmentation fault after
    that line, with no Python frame in the main thread."""
    logs = [result.worker_logs.get(rank, "") for rank in range(nproc)]
    if result.timed_out or not all(done in log for log in logs) or failed_checks(result):
        return False
    crashed = [log for log in logs if _SEGFAULT in log]
    return bool(crashed) and all(
        log.index(_SEGFAULT) > log.rindex(done) and "<no Python frame>" in log[log.index(_SEGFAULT) :]
        for log in crashed
    )


def _worker_env(env: dict[str, str | None] | None, device_path: bool) -> dict[str, str]:
    """The workers' environment: this process's, the repository on the path, the switch, then
    ``env`` (a ``None`` value removes its variable)."""
    # Workers import shared test models as `tests.…`: put the repository root on their path. The
    # back end's wait limit comes from the workers' own time-outs unless a test passes one.
    # Host-blocking dispatch is set, not inherited, as the multi-rank suites have always run
    # (device-path workers used to get it from this process); the device-path failure reports
    # also run without it, MindSpore's asynchronous host pipeline (docs/testing.md).
    chosen = {
        **{k: v for k, v in os.environ.items() if k != BACKEND_TIMEOUT_ENV},
        HOST_BLOCKING_ENV: "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **({FAST_PATHS_ENV: "0"} if device_path else {}),
        **(env or {}),
    }
    return {k: v for k, v in chosen.items() if v is not None}


def _launch(
    log_dir: Path,
    script: str,
    args: tuple[str, ...],
    nproc: int,
    timeout_s: float,
    env: dict[str, str],
    expect_ok: bool = True,
    done: str = _DONE,
) -> LaunchResult:
    """One launch; relaunched once after MindSpore's teardown race (:func:`crashed_only_at_exit`)."""
    result = launch(WORKERS / script, args, nproc=nproc, log_dir=log_dir, timeout_s=timeout_s, env=env)
    if expect_ok and result.returncode != 0 and crashed_only_at_exit(result, nproc, done):
        # MindSpore's teardown race, not the code under test: once more, and a second crash fails.
        print(f"{script}: a rank crashed after its last check (MindSpore teardown); relaunching once")
        result = launch(
            WORKERS / script, args, nproc=nproc, log_dir=log_dir / "relaunch", timeout_s=timeout_s, env=env
        )
    return result


def run_launch(
    log_dir: Path,
    script: str,
    nproc: int,
    *args: str,
    timeout_s: float = 240,
    expect_ok: bool = True,
    env: dict[str, str | None] | None = None,
    device_path: bool = False,
) -> LaunchResult:
    """Launch ``workers/script`` on ``nproc`` ranks and fail the test on any :func:`launch_problems`
    or :func:`policy_problems`. ``device_path``: the workers run with the CPU fast paths off
    (``GRAPH_EXEC_CPU_FAST_PATHS=0``), the path every GPU and Ascend rank takes, and each must
    say so (a ``POLICY`` line); otherwise they inherit the switch from this process's
    environment."""
    full_env = _worker_env(env, device_path)
    result = _launch(log_dir, script, args, nproc, timeout_s, full_env, expect_ok)
    expected = DevicePolicy.for_target("CPU", fast_paths_requested(full_env))
    problems = launch_problems(result, expect_ok) + policy_problems(result, expected, nproc)
    if problems:
        pytest.fail("\n".join([*problems, result.describe()]), pytrace=False)
    return result


def run_grouped(log_dir: Path, group: str, member: Member) -> LaunchResult:
    """``member``'s share of its group's launch (run by the first of the group's tests), judged
    as :func:`run_launch` judges a launch of its own."""
    full_env = _worker_env(None, member.device_path)
    if group not in _GROUP_RESULTS:
        members = _SELECTED[group]
        limit = sum(m.timeout_s for m in members)
        names = tuple(m.name for m in members)
        result = _launch(log_dir, "grouped.py", names, member.nproc, limit, full_env, done=ALL_MEMBERS_DONE)
        print(f"launch group {group}: {' '.join(names)} in {result.seconds:.0f} s (logs in {log_dir})")
        _GROUP_RESULTS[group] = result
    cut, missing = section(_GROUP_RESULTS[group], member)
    expected = DevicePolicy.for_target("CPU", fast_paths_requested(full_env))
    problems = missing + launch_problems(cut) + policy_problems(cut, expected, member.nproc)
    if problems:
        pytest.fail("\n".join([*problems, cut.describe()]), pytrace=False)
    return cut


@pytest.fixture
def run_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., LaunchResult]:
    """``run_workers(script, nproc, *args, timeout_s=..., expect_ok=True, env=None, device_path=False)``:
    see :func:`run_launch`.

    ``expect_ok=False`` only tolerates a non-zero exit (a job that is meant to fail); FAIL lines
    and time-outs still fail the test. Workers run in ``tmp_path``: what MindSpore writes into
    the working directory (``rank_0/om/analyze_fail.ir`` after a compile error) stays there.
    A suite of a launch group with other collected members comes from the group's one launch
    (:func:`run_grouped`; its limit is the table's, not ``timeout_s``); one with ``env`` or
    ``expect_ok=False`` always launches alone.
    """
    monkeypatch.chdir(tmp_path)

    def run(script: str, nproc: int, *args: str, **options) -> LaunchResult:
        found = find(script, nproc, args, options.get("device_path", False))
        alone = options.get("env") or not options.get("expect_ok", True)
        if found is not None and found[1] in _SELECTED.get(found[0], ()) and not alone:
            return run_grouped(tmp_path / "logs", *found)
        return run_launch(tmp_path / "logs", script, nproc, *args, **options)

    return run
