"""Parent side of ``graph-exec run`` and ``bench``: checks before launching, live progress.

Everything a user can get wrong is checked while parsing, so a bad value exits with code 2
and a message naming it before msrun starts. The launch itself goes through
:func:`graph_exec.launch.launch` (free port, cluster time-out, hard wall-clock limit); while it
runs, the parent tails the last-stage worker's log and hands every progress line to the
caller, so the user sees training happen rather than a silent wait.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from graph_exec.launch import LaunchResult, launch
from graph_exec.report.job import PROGRESS, JobSpec

WORKER = Path(__file__).with_name("worker.py")


def output_file(text: str) -> Path:
    """argparse type: a file path we can create or overwrite (checked now, written later)."""
    path = Path(text).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return path


def log_directory(text: str) -> Path:
    """argparse type: a directory that exists and is writable, or can be created."""
    path = Path(text).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot use {text!r} as a log directory: {str(existing)!r} is a file"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write to log directory {text!r}: permission denied")
    return path


def add_launch_arguments(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    """``--timeout``, ``--log-dir`` and ``--no-pin``, shared by ``run`` and ``bench``."""
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=_seconds,
        default=timeout_s,
        help=f"kill the whole job after S seconds (default {timeout_s:g})",
    )
    parser.add_argument(
        "--log-dir",
        metavar="DIR",
        type=log_directory,
        help="keep the job here: job.json, per-rank records, logs/worker_<rank>.log "
        "(default: a temporary directory, removed after a successful run)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin_cores",
        action="store_false",
        help="do not bind each rank to its own share of the CPU cores (bound by default: ranks then "
        "do not slow each other down, as ranks on separate devices would not)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a number of seconds > 0")
    return value


class JobFailed(Exception):
    """The job did not succeed (already reported on stderr); ``code`` is the exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextmanager
def run_directory(log_dir: Path | None) -> Iterator[Path]:
    """The job's directory: ``log_dir`` if given (kept), else a temporary one removed unless
    the block raises (a failed job's logs stay for the user to read)."""
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        yield log_dir
        return
    path = Path(tempfile.mkdtemp(prefix="graph-exec-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class _LogTail:
    """New complete lines of a file that may not exist yet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = ""

    def lines(self) -> list[str]:
        try:
            with self.path.open("r", encoding="utf-8", errors="replace") as log:
                log.seek(self.offset)
                text = log.read()
                self.offset = log.tell()
        except FileNotFoundError:
            return []
        *complete, self.partial = (self.partial + text).split("\n")
        return complete


def run_job(
    job: JobSpec, run_dir: Path, timeout_s: float, on_progress: Callable[[dict], None]
) -> LaunchResult:
    """Launch ``job`` on ``job.ranks`` local ranks, calling ``on_progress`` per progress line.

    msrun starts every worker in a session of its own, so killing msrun's process group (what
    the launcher does on time-out) leaves the workers running. The processes of the job are
    therefore recorded while it runs, and whatever is left of them is killed when the job
    times out or the user interrupts it.
    """
    job.write(run_dir)
    outcome: dict[str, LaunchResult | BaseException] = {}

    def target() -> None:
        try:
            outcome["result"] = launch(
                WORKER, [str(run_dir)], nproc=job.ranks, log_dir=run_dir / "logs", timeout_s=timeout_s
            )
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc

    tail = _LogTail(run_dir / "logs" / f"worker_{job.ranks - 1}.log")  # the last stage's rank
    thread = threading.Thread(target=target, name="graph-exec-launch", daemon=True)
    thread.start()
    started: dict[int, str] = {}  # pid -> its start time, so a reused pid is never killed
    try:
        while thread.is_alive():
            started.update(_descendants(os.getpid()))
            thread.join(0.25)
            _echo(tail.lines(), on_progress)
    except KeyboardInterrupt:
        started.update(_descendants(os.getpid()))
        _kill(started)
        raise
    _echo(tail.lines(), on_progress)
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    if result.timed_out:
        _kill(started)
    return result


def execute(
    job: JobSpec, run_dir: Path, timeout_s: float, on_progress: Callable[[dict], None], prog: str
) -> LaunchResult:
    """:func:`run_job`; a failure or Ctrl-C is reported on stderr and raised as :class:`JobFailed`."""
    try:
        result = run_job(job, run_dir, timeout_s, on_progress)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted, the job was stopped; logs in {run_dir}", file=sys.stderr)
        raise JobFailed(130) from None
    if not result.ok:
        print(result.describe(tail_lines=40), file=sys.stderr)
        print(f"{prog}: failed; logs kept in {run_dir}", file=sys.stderr)
        raise JobFailed(1)
    return result


def _echo(lines: list[str], on_progress: Callable[[dict], None]) -> None:
    for line in lines:
        if line.startswith(PROGRESS):
            on_progress(json.loads(line[len(PROGRESS) :]))


def _processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, start time), from /proc."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        out[int(stat.parent.name)] = (int(fields[1]), fields[19])  # ppid, starttime
    return out


def _descendants(root: int) -> dict[int, str]:
    """The processes below ``root`` (pid -> start time)."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def _kill(started: dict[int, str]) -> None:
    """SIGKILL every recorded process that is still the one recorded."""
    alive = _processes()
    for pid, start in started.items():
        if pid in alive and alive[pid][1] == start:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
