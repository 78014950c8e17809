"""What a user sees when things go wrong, or right: real launches, no mocks.

- A worker killed with SIGKILL mid-run: ``graph-exec run`` names the rank and the signal and
  the job ends well within the schedule's time-out.
- A launcher stopped with SIGTERM (as ``timeout`` does) ends every process it started,
  msrun's ``tail -f`` log followers included.
- ``graph-exec run embed_lm --steps 2`` prints no ``[ERROR]`` and no MindSpore ``[WARNING]``
  line (nor do its worker logs), with ``GLOG_v`` unset.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

COMMAND = [sys.executable, "-m", "graph_exec.cli"]
#: The job's limit below (its peer deadline, every wait for a peer, is a third of it).
SCHEDULE_TIMEOUT_S = 100


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a test's own temporary path)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def _worker_pid(job_dir: Path, rank: int) -> int | None:
    for pid in _pids_mentioning(str(job_dir)):
        env = _environ(pid)
        if env.get("MS_ROLE") == "MS_WORKER" and env.get("RANK_ID") == str(rank):
            return pid
    return None


def test_sigkilled_worker_is_named_with_its_signal_and_step(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    argv = [*COMMAND, "run", "embed_lm", "--steps", "300", "--timeout", str(SCHEDULE_TIMEOUT_S)]
    argv += ["--log-dir", str(job_dir)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed_at = None
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("step   2/") and killed_at is None:
                victim = _worker_pid(job_dir, 1)
                assert victim is not None, "no worker process of rank 1 found"
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()
        code = proc.wait(timeout=SCHEDULE_TIMEOUT_S + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "\n".join(lines)
    assert killed_at is not None, text
    assert code == 1, text
    assert time.monotonic() - killed_at < SCHEDULE_TIMEOUT_S, text
    assert "rank 1: died, killed by signal 9 (SIGKILL); last finished step" in text, text
    assert "rank 0: " in text
    assert not _pids_mentioning(str(job_dir)), "processes of the job outlived it"


def test_sigterm_to_the_launcher_ends_every_child(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    logs = tmp_path / "logs"
    driver = textwrap.dedent(
        f"""
        from graph_exec.launch import launch
        launch({str(script)!r}, nproc=2, log_dir={str(logs)!r}, timeout_s=300)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both workers and their log followers are up
            running = _pids_mentioning(str(tmp_path))
            if sum("worker_" in Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in running) >= 2:
                break
            time.sleep(0.5)
        assert len(_pids_mentioning(str(script))) >= 2, "the workers did not start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    # Killed children are gone within moments; under load the kernel may need more than one.
    deadline = time.monotonic() + 10
    while _pids_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pids_mentioning(str(tmp_path)), "children of the launcher outlived it by 10 s"


def test_successful_run_prints_no_error_and_no_mindspore_warning(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLOG_v"}
    argv = [*COMMAND, "run", "embed_lm", "--steps", "2", "--log-dir", str(tmp_path / "job")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "[ERROR]" not in output and "[WARNING]" not in output, output
    assert any(
        line.startswith("compiling... ") or line.startswith("ranks connected") for line in output.splitlines()
    )
    assert "training done; ranks are writing their records and exiting..." in output
    for log in (tmp_path / "job" / "logs").glob("worker_*.log"):
        text = log.read_text(errors="replace")
        assert "[ERROR]" not in text and "[WARNING]" not in text, f"{log.name}:\n{text}"


def test_job_timeout_dumps_every_worker_stack_into_its_log(tmp_path: Path) -> None:
    from graph_exec.launch import launch

    script = tmp_path / "stuck.py"
    script.write_text(
        "import time\n\n\ndef waiting_for_a_peer():\n    time.sleep(600)\n\n\nwaiting_for_a_peer()\n"
    )
    result = launch(script, nproc=2, log_dir=tmp_path / "logs", timeout_s=25)
    report = result.describe()
    assert result.timed_out, report
    assert report.startswith("msrun timed out after "), report
    for rank in (0, 1):
        assert "in waiting_for_a_peer" in result.worker_logs[rank], report  # faulthandler's dump
        assert f"rank {rank}: still running at the time-out (its stack is in its log)" in report
    assert not _pids_mentioning(str(tmp_path)), "processes of the job outlived it"
