"""Parent side of ``graph-exec run`` and ``bench``: checks before launching, live progress.

Everything a user can get wrong is checked while parsing, so a bad value exits with code 2
and a message naming it before msrun starts. The launch itself goes through
:func:`graph_exec.launch.launch` (free port, cluster time-out, hard wall-clock limit); while it
runs, the parent tails the last-stage worker's log and hands every progress line to the
caller, so the user sees training happen rather than a silent wait.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from graph_exec.cli.argtypes import non_negative_int, port, positive_int, seconds
from graph_exec.cli.status import StatusPrinter
from graph_exec.device import TARGETS
from graph_exec.launch import DEFAULT_MASTER_PORT, LaunchResult, Nodes, launch
from graph_exec.report.job import PROGRESS, JobSpec, RunSpec
from graph_exec.report.status import STATUS
from graph_exec.schedule import PlanConfigError, check_plan_size

#: The script msrun starts on every rank (the harness lives apart from the command line).
WORKER = Path(__file__).parents[1] / "harness" / "worker.py"


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


#: The peer deadline's default: a third of the job's limit, at most this many seconds.
PEER_TIMEOUT_CAP_S = 60.0


def peer_timeout(args: argparse.Namespace, parser: argparse.ArgumentParser) -> float:
    """The job's peer deadline: ``--peer-timeout``, default min(:data:`PEER_TIMEOUT_CAP_S`,
    ``--timeout`` / 3); one that is not below ``--timeout`` exits with code 2 (the job's limit
    would always strike first, and a hung rank would go unnamed)."""
    if args.peer_timeout is None:
        return min(PEER_TIMEOUT_CAP_S, args.timeout / 3)
    if args.peer_timeout >= args.timeout:
        parser.error(
            f"--peer-timeout {args.peer_timeout:g} must be below --timeout {args.timeout:g}: a hung rank is "
            "caught by its peers within the peer deadline, before the job's own limit"
        )
    return args.peer_timeout


def add_launch_arguments(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    """``--timeout``, ``--peer-timeout``, ``--log-dir``, ``--verbose`` and ``--no-pin``, shared by
    ``run`` and ``bench``."""
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=seconds,
        default=timeout_s,
        help=f"kill the whole job after S seconds (default {timeout_s:g})",
    )
    parser.add_argument(
        "--peer-timeout",
        metavar="S",
        type=seconds,
        help="a rank waits at most S seconds for another (a hung or stopped peer is then named and, with "
        f"--max-restarts, the job restarts); below --timeout (default min({PEER_TIMEOUT_CAP_S:g}, --timeout / 3))",
    )
    parser.add_argument(
        "--log-dir",
        metavar="DIR",
        type=log_directory,
        help="keep the job here: job.json, per-rank records, logs/worker_<rank>.log "
        "(default: a temporary directory, removed after a successful run)",
    )
    hosts = parser.add_argument_group(
        "multi-host",
        "run one launcher per host, each with the same --ranks, --nodes, --master-addr and "
        "--master-port and its own --node-rank; node 0 hosts the rendezvous",
    )
    hosts.add_argument(
        "--nodes", metavar="K", type=positive_int, default=1, help="hosts the job spans (default 1)"
    )
    hosts.add_argument(
        "--node-rank",
        metavar="I",
        type=non_negative_int,
        default=0,
        help="this host's index, 0..K-1 (default 0)",
    )
    hosts.add_argument(
        "--master-addr",
        metavar="HOST",
        default="127.0.0.1",
        help="address of node 0, reachable from every host (default 127.0.0.1)",
    )
    hosts.add_argument(
        "--master-port",
        metavar="PORT",
        type=port,
        help=f"rendezvous port on node 0 (default: a free port on one node, {DEFAULT_MASTER_PORT} on several)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="keep MindSpore's warnings in the worker logs (quiet by default: errors only)",
    )
    parser.add_argument(
        "--device",
        choices=TARGETS,
        default="CPU",
        help="MindSpore device target of every rank; on GPU and Ascend rank r of a host uses its device r "
        "(default CPU)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin_cores",
        action="store_false",
        help="on CPU, do not bind each rank to its own share of the cores (bound by default: ranks then "
        "do not slow each other down, as ranks on separate devices would not)",
    )


def checked_job(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    runs: tuple[RunSpec, ...],
    *,
    micro: int,
    batch: int,
    steps: int,
    warmup: int,
    calibrate: bool = False,
) -> JobSpec:
    """The job the shared model and launch options describe, if every run's plan can be
    built; else exit with code 2 naming the run."""
    nodes_of(args, parser)
    job = JobSpec(
        example=args.example,
        size=args.size,
        ranks=args.ranks,
        vpp=args.vpp,
        micro=micro,
        batch=batch,
        steps=steps,
        warmup=warmup,
        runs=runs,
        lr=args.lr,
        timeout_s=peer_timeout(args, parser),
        pin_cores=args.pin_cores,
        calibrate=calibrate,
        dp=args.dp,
        nodes=args.nodes,
        verbose=args.verbose,
        device=args.device,
    )
    for spec in job.runs:
        try:
            check_plan_size(job.plan_config(spec), what="every rank's plan")
        except PlanConfigError as err:
            parser.error(f"run {spec.name}: {err}" if len(job.runs) > 1 else str(err))
    return job


def nodes_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Nodes:
    """The hosts the launch options describe; an impossible set exits with code 2."""
    if not 0 <= args.node_rank < args.nodes:
        parser.error(
            f"--node-rank {args.node_rank} is outside [0, {args.nodes}): with --nodes {args.nodes} "
            f"the node ranks are 0..{args.nodes - 1}"
        )
    if args.ranks % args.nodes:
        parser.error(
            f"--ranks {args.ranks} is not a multiple of --nodes {args.nodes}: every host runs the same "
            "number of workers"
        )
    return Nodes(args.nodes, args.node_rank, args.master_addr, args.master_port)


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


def progress_rank(job: JobSpec) -> int:
    """The global rank that prints progress: the last pipeline rank of replica 0."""
    return job.pp - 1


@dataclass(frozen=True)
class Restarts:
    """Relaunch a failed job at most ``limit`` times; ``next_job(attempt)`` is the job attempt
    ``attempt`` runs (resumed from the latest checkpoint), or why there is none."""

    limit: int
    next_job: Callable[[int], JobSpec | str]


def run_job(
    job: JobSpec,
    run_dir: Path,
    timeout_s: float,
    on_progress: Callable[[dict], None],
    nodes: Nodes | None = None,
    restarts: Restarts | None = None,
) -> LaunchResult:
    """Launch ``job`` (this host's share of its ranks), calling ``on_progress`` per progress
    line of the last stage of replica 0 while it runs, where that rank runs on this host;
    with ``restarts``, relaunch it as :func:`graph_exec.launch.launch` decides, each attempt on
    the ranks of the job ``restarts.next_job`` gave it."""
    job.write(run_dir)
    logs = run_dir / "logs"
    latest = [job]  # the job of the latest attempt (a relaunch may run on fewer ranks)

    def watching(job: JobSpec) -> list:
        log = logs / f"worker_{progress_rank(job)}.log"
        return [_LogTail(log), StatusPrinter(job.ranks, lambda text: print(text, flush=True))]

    watch = watching(job)
    env = dict(os.environ)
    if job.verbose:  # MindSpore's warnings back (or the level the user chose)
        env.setdefault("GLOG_v", "2")
    else:
        env["GLOG_v"] = "3"

    def before_restart(next_job: Callable[[int], JobSpec | str], attempt: int) -> str | None:
        """The next attempt's job written for its workers, and the watch on its fresh logs."""
        following = next_job(attempt)
        if isinstance(following, str):
            return following
        following.write(run_dir)
        latest.append(following)
        watch[:] = watching(following)
        return None

    return launch(
        WORKER,
        [str(run_dir)],
        nproc=job.ranks,
        log_dir=logs,
        timeout_s=timeout_s,
        env=env,
        poll=lambda: _echo(watch[0].lines(), on_progress, watch[1]),
        nodes=nodes,
        max_restarts=0 if restarts is None else restarts.limit,
        checkpoint_dir=job.checkpoint_dir,
        steps_done=steps_finished,
        before_restart=None if restarts is None else functools.partial(before_restart, restarts.next_job),
        nproc_of=lambda attempt: latest[-1].ranks,
    )


def execute(
    job: JobSpec,
    run_dir: Path,
    timeout_s: float,
    on_progress: Callable[[dict], None],
    prog: str,
    nodes: Nodes | None = None,
    restarts: Restarts | None = None,
) -> LaunchResult:
    """:func:`run_job`; a failure or Ctrl-C is reported on stderr and raised as :class:`JobFailed`."""
    if nodes is not None and nodes.count > 1:
        host = progress_rank(job) // (job.ranks // nodes.count)
        where = "this host" if host == nodes.rank else f"node {host}"
        print(
            f"{prog}: node {nodes.rank} of {nodes.count}, {job.ranks // nodes.count} local workers, "
            f"rendezvous at {nodes.master_addr}:{nodes.master_port or DEFAULT_MASTER_PORT}; "
            f"progress lines appear on {where}",
            flush=True,
        )
    try:
        result = run_job(job, run_dir, timeout_s, on_progress, nodes, restarts)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted, the job was stopped; logs in {run_dir}", file=sys.stderr)
        raise JobFailed(130) from None
    if not result.ok:
        print(result.describe(tail_lines=40, last_step=last_finished_step), file=sys.stderr)
        if restarts is not None and len(result.attempts) == 1:  # describe() lists two or more
            print(f"{prog}: {result.attempts[0].describe()}", file=sys.stderr)
        print(f"{prog}: failed; logs kept in {run_dir}", file=sys.stderr)
        raise JobFailed(1)
    return result


def steps_finished(log: str) -> int:
    """From a worker's log: how many steps of the training it has finished (the steps of its
    checkpoint when it resumed, or was loading it, and finished none since; 0 when it finished
    none at all)."""
    done = 0
    for line in log.splitlines():
        if line.startswith(PROGRESS):
            entry = json.loads(line[len(PROGRESS) :])
            done = entry.get("resuming", entry.get("resumed", entry.get("step", -1) + 1))
    return done


def last_finished_step(log: str) -> str:
    """From a worker's log: the last step its progress lines say it finished."""
    lines = [json.loads(line[len(PROGRESS) :]) for line in log.splitlines() if line.startswith(PROGRESS)]
    done = [line for line in lines if "step" in line]
    if done:
        return f"last finished step {done[-1]['step'] + 1} (run {done[-1]['run']})"
    loads = [line for line in lines if "resuming" in line or "resumed" in line]
    if loads and "resumed" in loads[-1]:
        return f"no step finished after loading checkpoint step {loads[-1]['resumed']}"
    if loads:
        return f"no step finished: it failed while loading checkpoint step {loads[-1]['resuming']}"
    return "no step finished (it failed in start-up or in its first step)"


def _echo(
    lines: list[str], on_progress: Callable[[dict], None], on_status: Callable[[dict], None] | None = None
) -> None:
    for line in lines:
        if line.startswith(PROGRESS):
            on_progress(json.loads(line[len(PROGRESS) :]))
        elif on_status is not None and line.startswith(STATUS):
            on_status(json.loads(line[len(STATUS) :]))
