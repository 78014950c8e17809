"""Data parallel x pipeline parallel under msrun: 4 ranks, one launch for every layout and the
bad-input checks (see tests/multirank/workers/mesh_checks.py for what each check compares)."""

from tests.multirank.conftest import checks

CASES = (
    "dp2pp2_trainable_central",
    "dp2pp2_trainable_owner",
    "dp2pp2_frozen",
    "dp2pp2_baseline",
    "dp2pp2_replicas_start_equal",
    "dp4pp1_trainable",
    "dp4pp1_none_unscaled",
)
BAD_INPUTS = (
    "bad.mesh_before_init",
    "bad.dp_times_pp_not_world",
    "bad.ranks_disagree_on_mesh",
    "bad.replicas_disagree",
    "bad.setup_failure_stops_all_replicas",
)


def test_data_parallel_pipelines_match_the_global_batch_reference(run_workers):
    result = run_workers("mesh_checks.py", 4, "all", timeout_s=900)
    for rank in range(4):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        seen = checks(result, rank)
        assert {f"{case}.grads" for case in CASES} <= seen, result.describe()
        assert set(BAD_INPUTS) <= seen, result.describe()
    # Losses are checked where they live: the last pipeline rank of each replica (pp=2: ranks 1
    # and 3) and every rank of the pp=1 layout.
    for rank in (1, 3):
        assert {f"{case}.losses" for case in CASES} <= checks(result, rank)
    for rank in (0, 2):
        assert "dp4pp1_trainable.losses" in checks(result, rank)


ZERO_CHECKS = ("losses_equal", "norms_equal", "clipped", "params_equal", "params_trained", "state_halved")


def test_optimizer_sharding_matches_the_unsharded_run(run_workers):
    """ZeRO-1 on dp 2 x pp 2, graph and pynative, Adam with clipping and a dynamic loss scaler:
    the losses, norms and every parameter after 3 steps bit-identical to the unsharded run, the
    optimizer state per rank half of it (within one parameter's), a resume from a sharded
    checkpoint exact (graph mode), and so, bit for bit with the generator restored, a sharded
    checkpoint resumed unsharded and an unsharded one sharded (graph mode, 2 steps on); an
    optimizer over another replica's parameters or with state not per parameter refused on every
    rank (pynative) (tests/multirank/workers/mesh_checks.py, suite ``zero``)."""
    result = run_workers("mesh_checks.py", 4, "zero", timeout_s=600)
    for rank in range(4):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        seen = checks(result, rank)
        for mode in ("graph", "pynative"):
            expected = {f"zero_{mode}.{check}" for check in (*ZERO_CHECKS, "stats")}
            assert expected <= seen, result.describe()
        resumes = ("resume_exact", "resume_sharded_into_unsharded", "resume_unsharded_into_sharded")
        assert {f"zero_graph.{check}" for check in resumes} <= seen, result.describe()
        refusals = ("refuses_not_owned", "refuses_global_state", "refusals_update_nothing")
        assert {f"zero_pynative.{check}" for check in refusals} <= seen, result.describe()


def test_two_loopback_hosts_give_the_numbers_of_one_launch(tmp_path):
    """Two launchers, one per "host" (node 0 and node 1, 2 workers each, on this machine),
    against one 4-worker launch of the same job: the same per-step losses (rtol 1e-6; the
    losses after step 1 depend on every replica-averaged gradient through Adam), every rank's
    record on both hosts, and progress lines where replica 0's last stage runs (node 0)."""
    import json
    import os
    import subprocess
    import sys

    from graph_exec.launch import free_port

    command = [sys.executable, "-m", "graph_exec.cli", "run", "embed_lm", "--ranks", "4", "--dp", "2"]
    command += ["--steps", "2", "--timeout", "400"]
    env = {**os.environ, "GLOG_v": "3"}
    single = subprocess.run(
        [*command, "--log-dir", str(tmp_path / "one")], capture_output=True, text=True, timeout=450, env=env
    )
    assert single.returncode == 0, single.stdout + single.stderr
    port = str(free_port())

    def host_flags(node: int) -> list[str]:
        return ["--nodes", "2", "--node-rank", str(node), "--master-port", port]

    hosts = [
        subprocess.Popen(
            [*command, *host_flags(node), "--log-dir", str(tmp_path / f"node{node}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [host.communicate(timeout=450)[0] for host in hosts]
    finally:
        for host in hosts:
            if host.poll() is None:
                host.kill()
    for host, text in zip(hosts, outputs, strict=True):
        assert host.returncode == 0, text
    assert "step   2/2  [dp=2 x pp=2]" in outputs[0]
    assert "progress lines appear on node 0" in outputs[1]
    assert not [line for line in outputs[1].splitlines() if line.startswith("step ")]

    def losses(directory):
        record = json.loads((tmp_path / directory / "run.rank1.json").read_text())
        return [step["loss"] for step in record["steps"]]

    expected = losses("one")
    assert len(expected) == 2 and all(loss is not None for loss in expected)
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (tmp_path / node).glob("run.rank*.json")) == [
            f"run.rank{r}.json" for r in range(4)
        ]
        got = losses(node)
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, expected, strict=True)), (got, expected)
