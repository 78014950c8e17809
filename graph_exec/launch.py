"""Launch a script on N ranks with MindSpore's own launcher, ``msrun``: all of them on this
host over loopback, or this host's share of a multi-host job (one launch per host).

Used by ``graph-exec run``/``bench`` and by the multi-rank tests, so both get the same
guarantees: a free port, a log directory with one log per worker, a cluster time-out (so a
worker that dies early does not leave msrun waiting its default 600 s) and a hard wall-clock
limit. msrun starts every worker in a session of its own, so killing msrun's process group
would leave the workers running: the processes of the job are recorded while it runs (with
the rank each worker runs), and whatever is left of them — workers, msrun's ``tail -f`` log
followers — is killed when the job ends, times out, or the caller is interrupted or sent
SIGTERM. On a time-out every worker is first asked for a Python stack dump (SIGABRT with
``PYTHONFAULTHANDLER``), so its log says where it was stuck. A failure report names the rank
that died and how (:mod:`graph_exec.launch_report`); the job ends :data:`FAILED_GRACE_S` after
msrun reported a failed worker. With ``max_restarts`` a job whose rank died or timed out is
launched again, once every process of the failed attempt is gone (:mod:`graph_exec.restarts`
decides what is worth a restart).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from graph_exec import checks
from graph_exec.launch_report import failure_report, is_stack_dump, worker_exits
from graph_exec.restarts import ATTEMPT_ENV, HUNG, Attempt, classify, run_attempts

#: Seconds the workers get to write their stack dumps before a timed-out job is killed.
DUMP_GRACE_S = 2.0

#: msrun's own default rendezvous port, used when several hosts must agree on one.
DEFAULT_MASTER_PORT = 8118

#: What msrun logs for the first failed worker it finds (before it kills the others).
_WORKER_FAILED = "exit with exception. Error code:"

#: Seconds msrun gets to end by itself after it reported a failed worker. It kills the other
#: workers at once but then waits for its scheduler process, which notices their loss only
#: after its heartbeat time-out (a kill took 29 s to report here): the launcher ends it instead.
FAILED_GRACE_S = 1.0

#: Seconds to wait for the killed processes of a job to be gone (a restart waits for them).
EXIT_WAIT_S = 30.0


@dataclass(frozen=True)
class Nodes:
    """Where this launcher sits in a multi-host job: one msrun per host, all meeting at
    ``master_addr:master_port`` (node 0's address; ``None`` port: a free one on one host,
    :data:`DEFAULT_MASTER_PORT` on several). Each host runs ``nproc / count`` workers; msrun
    gives host ``rank`` the global ranks ``rank * nproc / count …``."""

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.rank < self.count:
            raise ValueError(f"node rank {self.rank} is outside [0, {self.count}) for {self.count} nodes")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LaunchResult:
    """What a launch left behind: exit code, time taken and every worker's log — of its last
    attempt; ``attempts`` lists every attempt (one without restarts). ``returncode`` is msrun's
    (1 when the launcher ended msrun after it reported a failed worker)."""

    returncode: int
    timed_out: bool
    seconds: float
    log_dir: Path
    output: str
    worker_logs: dict[int, str] = field(default_factory=dict)
    #: ``{rank: exit code}`` of the workers msrun saw fail (negative: killed by that signal).
    exits: dict[int, int] = field(default_factory=dict)
    timeout_s: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    #: msrun's scheduler's log: it names a worker whose heartbeat stopped (a stopped process).
    scheduler_log: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self, tail_lines: int = 60, last_step: Callable[[str], str | None] | None = None) -> str:
        """A failure report: what happened to every rank (``last_step(log)`` may say which step it
        finished last), then the tail of every worker's log."""
        if self.timed_out:
            limit = "" if self.timeout_s is None else f" (limit {self.timeout_s:g} s)"
            head = f"msrun timed out after {self.seconds:.1f} s{limit}"
        else:
            head = f"msrun exit code {self.returncode} after {self.seconds:.1f} s"
        head = f"{head} (logs in {self.log_dir})"
        if len(self.attempts) > 1:
            head += "".join(f"\n  {attempt.describe()}" for attempt in self.attempts)
        return failure_report(
            headline=head,
            worker_logs=self.worker_logs,
            exits=self.exits,
            msrun_output=self.output,
            tail_lines=tail_lines,
            last_step=last_step,
            timed_out=self.timed_out,
            hung=self._hung(),
        )

    def _hung(self) -> tuple[int, str] | None:
        """``(rank, why)`` of the rank this attempt's record names as hung, if it names one."""
        failure = classify(
            returncode=self.returncode,
            timed_out=self.timed_out,
            exits=self.exits,
            worker_logs=self.worker_logs,
            msrun_output=self.output,
            scheduler_log=self.scheduler_log,
        )
        if failure is None or failure.cause != HUNG or failure.rank is None:
            return None
        return failure.rank, failure.detail.split(": ", 1)[1]


def msrun_executable() -> str:
    """The ``msrun`` next to this interpreter (a venv's), else the one on PATH."""
    local = Path(sys.executable).with_name("msrun")
    found = str(local) if local.exists() else shutil.which("msrun")
    if found is None:
        raise FileNotFoundError(
            "msrun not found: install mindspore in this environment (pip install mindspore)"
        )
    return found


#: msrun, told that this host is not the master. msrun starts the rendezvous scheduler on every
#: host whose own addresses include ``--master_addr``; on one machine standing in for several
#: hosts (loopback tests) every launcher would start one and all but node 0's would fail. Only
#: node 0 ever hosts it, so the launchers of the other nodes run msrun with that check off (on
#: real separate hosts the check says "no" anyway).
_MSRUN_NOT_MASTER = (
    "import sys; import mindspore.parallel.cluster.process_entity._api as api; "
    "api._is_local_ip = lambda address: False; "
    "from mindspore.parallel.cluster.run import main; sys.argv[0] = 'msrun'; sys.exit(main())"
)


def msrun_command(nodes: Nodes) -> list[str]:
    """How to start msrun on this host (see :data:`_MSRUN_NOT_MASTER` for nodes other than 0)."""
    msrun = msrun_executable()
    if nodes.count > 1 and nodes.rank > 0:
        return [sys.executable, "-c", _MSRUN_NOT_MASTER]
    return [msrun]


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nproc: int,
    log_dir: str | os.PathLike[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cluster_timeout_s: int = 30,
    poll: Callable[[], None] | None = None,
    nodes: Nodes | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    steps_done: Callable[[str], int | None] | None = None,
    before_restart: Callable[[int], str | None] | None = None,
    nproc_of: Callable[[int], int] | None = None,
) -> LaunchResult:
    """Run ``script args`` on ``nproc`` ranks under msrun and wait at most ``timeout_s``.

    msrun's own option parser sees ``args`` too and accepts abbreviations, so a script option
    that abbreviates one of msrun's (``--worker`` for ``--worker_num``) is taken by msrun: pass
    positional arguments or unambiguous option names.

    ``poll`` is called about four times a second while the job runs (and once after), e.g. to
    show progress from the worker logs. msrun's own output goes to ``log_dir/msrun.out``.

    ``nodes``: this host's place in a multi-host job (``nproc`` counts the ranks of every host;
    this call starts its share); default: every rank here, on loopback.

    ``max_restarts``: launch again, at most that many times, after an attempt whose rank died
    by a signal or timed out (:func:`graph_exec.restarts.classify` and ``decide`` say what is
    retried), once every process of the failed attempt is gone, on a fresh port, with the same
    arguments; the script resumes itself (``ge.latest_checkpoint``). Every worker sees its
    attempt number in ``GRAPH_EXEC_ATTEMPT``; attempt ``i``'s logs move to ``log_dir/attempt_<i>``
    when the next one starts, and one line per restart goes to stderr. ``checkpoint_dir`` (the
    job's checkpoints) and ``steps_done(worker log) -> steps finished`` let the attempt records
    say where each attempt resumed and what a failure cost. ``before_restart(attempt)`` runs
    before each relaunch and may return a reason not to relaunch. ``nproc_of(attempt)``: the
    ranks of attempt ``attempt > 0`` (called after ``before_restart``, which may have re-planned
    the job on fewer ranks); default ``nproc`` every time.
    """
    nodes = nodes or Nodes()
    timeout_s = checks.positive_seconds("timeout_s", timeout_s)
    _check_request(script, nproc, nodes, max_restarts)
    log_path = _fresh_log_dir(Path(log_dir))

    def attempt(index: int) -> tuple[LaunchResult, bool]:
        ranks = nproc
        if index:
            _archive_logs(log_path, index - 1)
            ranks = nproc if nproc_of is None else _checked_nproc(nproc_of(index), index)
        return _launch_once(
            script, args, ranks, log_path, timeout_s, env, cluster_timeout_s, poll, nodes, index
        )

    result, attempts = run_attempts(
        attempt,
        max_restarts=max_restarts,
        checkpoint_dir=checkpoint_dir,
        steps_done=steps_done,
        before_restart=before_restart,
        exit_wait_s=EXIT_WAIT_S,
    )
    result.attempts = attempts
    return result


def _checked_nproc(nproc: int, attempt: int) -> int:
    """``nproc_of``'s answer for ``attempt``, if it is a rank count."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc_of({attempt}) must be an int >= 1, got {nproc!r}")
    return nproc


def _archive_logs(log_path: Path, index: int) -> None:
    """Move attempt ``index``'s logs (``*.log``, ``msrun.out``) to ``log_path/attempt_<index>``."""
    target = log_path / f"attempt_{index}"
    target.mkdir(exist_ok=True)
    for path in [*log_path.glob("*.log"), log_path / "msrun.out"]:
        if path.is_file():
            path.replace(target / path.name)


def _check_request(script: str | os.PathLike[str], nproc: int, nodes: Nodes, max_restarts: object) -> None:
    """Refuse a launch that cannot work, before anything starts."""
    if not Path(script).is_file():
        raise FileNotFoundError(f"cannot launch {str(script)!r}: no such script file")
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if nproc % nodes.count:
        raise ValueError(f"{nproc} ranks cannot be split evenly over {nodes.count} nodes")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if max_restarts and nodes.count > 1:
        raise ValueError(
            f"max_restarts={max_restarts} needs a job on one host: the launchers of {nodes.count} hosts "
            "cannot agree on a relaunch; restart a multi-host job from its checkpoint by hand (--resume)"
        )


def _fresh_log_dir(log_path: Path) -> Path:
    """``log_path``, made, without the ``attempt_<i>`` folders of an earlier job (their logs
    would read as this job's attempts)."""
    log_path.mkdir(parents=True, exist_ok=True)
    for old in log_path.glob("attempt_*"):
        if old.is_dir() and old.name[len("attempt_") :].isdigit():
            shutil.rmtree(old, ignore_errors=True)
    return log_path


def _launch_once(
    script: str | os.PathLike[str],
    args: Sequence[str],
    nproc: int,
    log_path: Path,
    timeout_s: float,
    env: Mapping[str, str] | None,
    cluster_timeout_s: int,
    poll: Callable[[], None] | None,
    nodes: Nodes,
    attempt: int,
) -> tuple[LaunchResult, bool]:
    """One msrun job; also whether every process it started is gone (waited for, bounded)."""
    port = nodes.master_port or (free_port() if nodes.count == 1 else DEFAULT_MASTER_PORT)
    for old in log_path.glob("*.log"):
        old.unlink()
    cmd = _command(script, args, nproc, nodes, port, cluster_timeout_s, log_path)
    job = _Job(cmd, _environment(env, attempt), log_path)
    with _sigterm_as_exit():
        try:
            job.poll_until_done(timeout_s, poll)
        finally:
            gone = job.kill()
    if poll is not None:
        poll()
    return job.collect(timeout_s), gone


def _command(
    script: str | os.PathLike[str],
    args: Sequence[str],
    nproc: int,
    nodes: Nodes,
    port: int,
    cluster_timeout_s: int,
    log_path: Path,
) -> list[str]:
    """msrun's command line for this host's share of the job."""
    return [
        *msrun_command(nodes),
        f"--worker_num={nproc}",
        f"--local_worker_num={nproc // nodes.count}",
        f"--master_addr={nodes.master_addr}",
        f"--master_port={port}",
        *([f"--node_rank={nodes.rank}"] if nodes.count > 1 else []),
        "--join=True",
        f"--cluster_time_out={cluster_timeout_s}",
        f"--log_dir={log_path}",
        str(script),
        *args,
    ]


def _environment(env: Mapping[str, str] | None, attempt: int) -> dict[str, str]:
    """The workers' environment: ``env`` (default: ours), this interpreter first on PATH
    (msrun starts workers with the ``python`` found first), quiet unbuffered logs, stack dumps
    on SIGABRT, and the attempt number."""
    child_env = dict(os.environ if env is None else env)
    child_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), child_env.get("PATH", "")])
    child_env.setdefault("GLOG_v", "3")
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.setdefault("PYTHONFAULTHANDLER", "1")  # stack dumps on SIGABRT (time-outs) and crashes
    child_env[ATTEMPT_ENV] = str(attempt)
    return child_env


class _Job:
    """One running msrun and what the launcher learns of its processes while it runs."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.output_path = log_path / "msrun.out"
        self.start = time.monotonic()
        with self.output_path.open("w") as output:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        self.started: dict[int, str] = {}  # pid -> start time, so that a reused pid is never killed
        self.rank_of_pid: dict[int, int] = {}
        self.seen_exits: dict[int, int] = {}  # rank -> exit code of the workers seen dead, in that order
        self.timed_out = False
        self.failed_at: float | None = None  # when msrun reported a failed worker

    def poll_until_done(self, timeout_s: float, poll: Callable[[], None] | None) -> None:
        """Watch the job about four times a second until msrun ends or :meth:`detect` ends it."""
        while self.proc.poll() is None:
            _record(self.proc.pid, self.started, self.rank_of_pid)
            _note_deaths(self.rank_of_pid, self.started, self.seen_exits, self.output_path)
            if poll is not None:
                poll()
            if self.detect(timeout_s):
                return
            time.sleep(0.25)

    def detect(self, timeout_s: float) -> bool:
        """Whether the job is over for the launcher: past its time limit (the workers are asked
        for their stacks first), or :data:`FAILED_GRACE_S` after msrun reported a failed worker
        (msrun has killed the workers and waits for its scheduler)."""
        now = time.monotonic()
        if now - self.start > timeout_s:
            self.timed_out = True
            _dump_stacks(self.started, self.rank_of_pid)
            return True
        if self.failed_at is None and _WORKER_FAILED in self.output_path.read_text(errors="replace"):
            self.failed_at = now
        return self.failed_at is not None and now - self.failed_at > FAILED_GRACE_S

    def kill(self) -> bool:
        """Kill whatever the job left (workers on a time-out or interrupt, msrun's ``tail -f``
        followers always) and wait, bounded, until it is gone; whether it is.

        msrun leads its own session, so killing its process group first also takes what it
        started since the last look (under load, a SIGTERM during start-up left a late follower
        behind); the recorded processes then cover any that left the group. msrun is not reaped
        yet, so its group id is not reused.
        """
        if self.proc.poll() is None:
            _record(self.proc.pid, self.started, self.rank_of_pid)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        _kill(self.started)
        self.proc.wait()
        return _wait_gone(self.started, EXIT_WAIT_S)

    def collect(self, timeout_s: float) -> LaunchResult:
        """What the job left behind: msrun's exit code (1 when the launcher ended it after its
        report of a failed worker), the logs, and the failed workers."""
        logs = {
            int(m.group(1)): p.read_text(errors="replace")
            for p in self.log_path.glob("worker_*.log")
            if (m := re.fullmatch(r"worker_(\d+)\.log", p.name))
        }
        scheduler = self.log_path / "scheduler.log"
        output_text = self.output_path.read_text(errors="replace")
        code = self.proc.returncode
        return LaunchResult(
            1 if self.failed_at is not None and code < 0 else code,
            self.timed_out,
            time.monotonic() - self.start,
            self.log_path,
            output_text,
            logs,
            exits=_failed_workers(output_text, self.rank_of_pid, self.seen_exits, self.timed_out),
            timeout_s=timeout_s,
            scheduler_log=scheduler.read_text(errors="replace") if scheduler.is_file() else "",
        )


def _failed_workers(
    output: str, rank_of_pid: dict[int, int], seen_exits: dict[int, int], timed_out: bool
) -> dict[int, int]:
    """The failed workers, in the order they died: those seen dead first (only failures), then
    msrun's report; after a time-out, the SIGABRTs of our stack dumps are not news."""
    exits = {rank: code for rank, code in seen_exits.items() if code != 0}
    for rank, code in worker_exits(output, rank_of_pid).items():
        exits.setdefault(rank, code)
    return {rank: code for rank, code in exits.items() if not is_stack_dump(code, timed_out)}


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While the job runs, SIGTERM (what ``timeout`` and service managers send) raises
    ``SystemExit(143)`` instead of ending this process at once, so the job's processes are
    killed on the way out. Only the main thread can handle signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _record(root: int, started: dict[int, str], rank_of_pid: dict[int, int]) -> None:
    """Add the new processes below ``root`` to ``started``, and the rank of each worker.

    A rank is looked for again at every look until it is found: msrun forks a worker with a
    ``preexec_fn`` and sets ``RANK_ID`` in its own ``os.environ``, so a child seen between fork
    and exec shows msrun's original environment, without ``MS_ROLE`` (the rank of a worker first
    seen then was never learnt, and its death was reported as "a worker's").
    """
    for pid, start_time in _descendants(root).items():
        started.setdefault(pid, start_time)
        if pid not in rank_of_pid and started[pid] == start_time:
            rank = _worker_rank(pid)
            if rank is not None:
                rank_of_pid[pid] = rank


def _note_deaths(
    rank_of_pid: dict[int, int], started: dict[int, str], seen_exits: dict[int, int], msrun_out: Path
) -> None:
    """Add to ``seen_exits`` the workers that died on their own, seen before msrun reaped them.

    msrun reports only the first failed worker it finds, polling once a second in rank order,
    and then kills the others: a peer that the dead rank took down may be reported instead. The
    dead are seen here first, unless msrun has reported already: after its report, the dead are
    its own victims (it logs before it kills, so a scan followed by no report saw none of them).
    """
    found = {}
    for pid, rank in rank_of_pid.items():
        if rank not in seen_exits:
            code = _zombie_exit(pid, started[pid])
            if code is not None:
                found[rank] = code
    if found and _WORKER_FAILED not in msrun_out.read_text(errors="replace"):
        seen_exits.update(found)


def _zombie_exit(pid: int, start: str) -> int | None:
    """The exit code of ``pid`` if it is that process, dead and not yet reaped (negative: the
    signal that killed it), else ``None``."""
    fields = _stat(pid)
    if fields is None or fields[0] != "Z" or fields[19] != start or len(fields) < 50:
        return None
    status = int(fields[49])  # exit_code, as waitpid(2) reports it
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def _worker_rank(pid: int) -> int | None:
    """``RANK_ID`` of an msrun worker process (``MS_ROLE=MS_WORKER``), else ``None``."""
    try:
        environ = dict(
            item.split("=", 1)
            for item in Path(f"/proc/{pid}/environ").read_text(errors="replace").split("\0")
            if "=" in item
        )
    except OSError:
        return None
    if environ.get("MS_ROLE") != "MS_WORKER" or not environ.get("RANK_ID", "").isdigit():
        return None
    return int(environ["RANK_ID"])


def _dump_stacks(started: dict[int, str], rank_of_pid: dict[int, int]) -> None:
    """Ask every live worker for its Python stacks (SIGABRT + faulthandler) before the kill."""
    alive = _processes()
    for pid in rank_of_pid:
        if pid in alive and alive[pid][1] == started.get(pid):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGABRT)
    deadline = time.monotonic() + DUMP_GRACE_S
    while time.monotonic() < deadline and any(p in _processes() for p in rank_of_pid):
        time.sleep(0.1)


def _processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, start time), from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        pid = int(stat.parent.name)
        fields = _stat(pid)
        if fields is not None:  # else gone meanwhile
            table[pid] = (int(fields[1]), fields[19])  # ppid, starttime
    return table


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first; ``None``: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


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


def _wait_gone(recorded: dict[int, str], limit_s: float) -> bool:
    """Wait until no recorded process runs any more (a zombie counts as gone: it holds no
    port, file or device); ``False`` if some still ran after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        running = [pid for pid, start in recorded.items() if _running(pid, start)]
        if not running:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _running(pid: int, start: str) -> bool:
    """Whether process ``pid`` is still the one that started at ``start`` and not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[19] == start and fields[0] != "Z"


def _kill(recorded: dict[int, str]) -> None:
    """SIGKILL every recorded process that is still the one recorded."""
    alive = _processes()
    for pid, start in recorded.items():
        if pid in alive and alive[pid][1] == start:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
