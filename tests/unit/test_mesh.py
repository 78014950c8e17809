"""The device mesh layout, gradient buckets and the data-parallel CLI flags, without launching.

Group creation and the averaged numbers on real ranks are checked in
tests/multirank/test_mesh.py; here: the arithmetic, the errors, and the bucketed average
against numpy with a stand-in for the peer.
"""

from __future__ import annotations

import numpy as np
import pytest

import graph_exec as ge
from graph_exec.cli import jobs, main
from graph_exec.errors import CommunicationNotInitializedError
from graph_exec.launch import Nodes
from graph_exec.transport.buckets import PackedTensors, plan_buckets
from graph_exec.transport.mesh import data_parallel_ranks, mesh_layout, replica_ranks


@pytest.mark.parametrize(
    ("world", "dp", "pp", "layout"),
    [
        (4, None, None, (1, 4)),
        (4, 2, None, (2, 2)),
        (4, None, 1, (4, 1)),
        (6, 3, 2, (3, 2)),
        (1, None, None, (1, 1)),
    ],
)
def test_layout_fills_in_the_missing_axis(world, dp, pp, layout):
    assert mesh_layout(world, dp, pp) == layout


@pytest.mark.parametrize(("dp", "pp"), [(3, 2), (3, None), (None, 3), (2, 1)])
def test_layout_that_does_not_cover_the_world_is_named(dp, pp):
    with pytest.raises(ValueError, match=r"needs dp x pp = world size, but the world has 4 ranks"):
        mesh_layout(4, dp, pp)


@pytest.mark.parametrize(("dp", "pp"), [(0, 2), (2, -1), (True, 4), (2.0, 2)])
def test_layout_values_must_be_positive_ints(dp, pp):
    with pytest.raises(ValueError, match="must be a positive int"):
        mesh_layout(4, dp, pp)


def test_replicas_are_neighbours_and_dp_groups_stride_by_pp():
    # dp=2, pp=3 over 6 ranks: replicas [0,1,2] and [3,4,5]; pipeline rank 1 of each averages together.
    assert replica_ranks(4, 3) == (3, 4, 5)
    assert replica_ranks(2, 3) == (0, 1, 2)
    assert data_parallel_ranks(4, 2, 3) == (1, 4)
    assert data_parallel_ranks(0, 3, 2) == (0, 2, 4)
    # every rank is in exactly one replica and one dp group, and the two meet only in itself
    for rank in range(6):
        assert set(replica_ranks(rank, 3)) & set(data_parallel_ranks(rank, 2, 3)) == {rank}


def test_mesh_before_init_is_an_error_naming_init():
    with pytest.raises(CommunicationNotInitializedError, match=r"before mindspore.communication.init\(\)"):
        ge.DeviceMesh(dp=2, pp=2)


def test_default_mesh_without_communication_is_one_process():
    mesh = ge.DeviceMesh()
    assert (mesh.dp_size, mesh.pp_size, mesh.dp_rank, mesh.pp_rank) == (1, 1, 0, 0)


def test_buckets_keep_order_split_on_size_and_dtype():
    sizes = [
        (400, "Float32"),
        (400, "Float32"),
        (400, "Float32"),
        (100, "Float16"),
        (2000, "Float16"),
        (8, "Float16"),
    ]
    buckets = plan_buckets(sizes, 1000)
    assert [b.indices for b in buckets] == [(0, 1), (2,), (3,), (4,), (5,)]
    assert [b.nbytes for b in buckets] == [800, 400, 100, 2000, 8]
    assert [b.indices for b in plan_buckets(sizes[:3], 10**6)] == [(0, 1, 2)]
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
        plan_buckets(sizes, 0)


class _TwoRanks:
    """Stands in for group rank ``rank`` of a 2-rank group whose peer holds ``peer`` (flat per
    bucket): a SUM adds the peer's values in place, a broadcast from the peer copies them."""

    size = 2

    def __init__(self, peer: list[np.ndarray], packed: PackedTensors, rank: int = 0) -> None:
        self.peer_flats = [np.concatenate([peer[i].ravel() for i in b.indices]) for b in packed.buckets]
        self.rank = rank
        self.calls = 0

    def all_reduce_sum(self, flats) -> None:
        self._check(flats)
        for flat, peer in zip(flats, self.peer_flats, strict=True):
            flat.asnumpy()[...] += peer  # a writable view on CPU

    def broadcast(self, flats, src: int) -> None:
        self._check(flats)
        if src != self.rank:
            for flat, peer in zip(flats, self.peer_flats, strict=True):
                flat.asnumpy()[...] = peer

    def _check(self, flats) -> None:
        self.calls += 1
        assert len(flats) == len(self.peer_flats)


def _arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (4,), (5, 2), (7,)]]


def _params(arrays: list[np.ndarray]) -> list:
    from mindspore import Parameter, Tensor

    return [Parameter(Tensor(a.copy()), name=f"g{i}") for i, a in enumerate(arrays)]


@pytest.fixture(params=["by address", "through ops"])
def packing(request: pytest.FixtureRequest):
    """Makes PackedTensors (64-byte buckets) on the CPU path (by address) or the generic one."""

    def make(params: list) -> PackedTensors:
        packed = PackedTensors(params, bucket_bytes=64)
        assert packed._by_address  # float32 parameters on CPU
        packed._by_address = request.param == "by address"
        return packed

    return make


def test_packed_average_writes_the_mean_back_in_place(packing) -> None:
    mine, peer = _arrays(0), _arrays(1)
    params = _params(mine)
    packed = packing(params)
    assert [b.indices for b in packed.buckets] == [(0, 1), (2,), (3,)]  # 48 + 16 | 40 (+ 28 > 64) | 28
    group = _TwoRanks(peer, packed)
    packed.average(group)
    assert group.calls == 1  # one collective call for all buckets
    for param, a, b in zip(params, mine, peer, strict=True):
        np.testing.assert_allclose(param.asnumpy(), (a + b) / 2, rtol=1e-6)


@pytest.mark.parametrize("rank", [0, 1])
def test_packed_broadcast_overwrites_all_but_the_source(packing, rank: int) -> None:
    mine, peer = _arrays(0), _arrays(1)
    params = _params(mine)
    packed = packing(params)
    packed.broadcast(_TwoRanks(peer, packed, rank=rank), src=0)
    for param, a, b in zip(params, mine, peer, strict=True):
        np.testing.assert_array_equal(param.asnumpy(), a if rank == 0 else b)


def test_packed_sum_of_increments_counts_what_was_there_once(packing) -> None:
    """At the snapshot the buffers hold ``before``, at the reduce ``before + mine``, and the peer
    added ``peer``: each must end at ``before + ((before + mine) - before + peer)``, the same
    float32 operations in the same order, so bit for bit."""
    from mindspore import Tensor, ops

    before, mine, peer = _arrays(0), _arrays(1), _arrays(2)
    params = _params(before)
    packed = packing(params)
    snapshot = packed.snapshot()
    for param, added in zip(params, mine, strict=True):
        ops.assign(param, param + Tensor(added))
    packed.sum_increments(_TwoRanks(peer, packed), snapshot)
    for param, b, m, p in zip(params, before, mine, peer, strict=True):
        np.testing.assert_array_equal(param.asnumpy(), b + ((b + m) - b + p))


def test_packed_tensors_alone_do_nothing() -> None:
    params = _params([np.ones(3, np.float32)])
    packed = PackedTensors(params)
    packed.average(None)
    packed.broadcast(None)
    packed.sum_increments(None, packed.snapshot())
    np.testing.assert_array_equal(params[0].asnumpy(), np.ones(3))


# -- CLI -----------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("msrun was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "embed_lm", "--ranks", "4", "--dp", "3"], "--dp 3 does not divide --ranks 4"),
        (["bench", "embed_lm", "--ranks", "6", "--dp", "4"], "--dp 4 does not divide --ranks 6"),
        (
            ["run", "embed_lm", "--ranks", "4", "--dp", "2", "--batch", "12"],
            "--batch 12 is not a multiple of --dp 2 x --micro 4",
        ),
        (
            ["run", "embed_lm", "--ranks", "4", "--nodes", "2", "--node-rank", "2"],
            "--node-rank 2 is outside [0, 2)",
        ),
        (
            ["bench", "embed_lm", "--ranks", "4", "--nodes", "2", "--node-rank", "5"],
            "--node-rank 5 is outside [0, 2)",
        ),
        (["run", "embed_lm", "--ranks", "3", "--nodes", "2"], "--ranks 3 is not a multiple of --nodes 2"),
        (["run", "embed_lm", "--master-port", "80"], "argument --master-port: invalid value '80'"),
        (["run", "embed_lm", "--dp", "0"], "argument --dp: invalid value '0'"),
    ],
)
def test_bad_mesh_and_host_flags_exit_2_naming_the_value(no_launch, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_dp_job_defaults_split_the_global_batch():
    import argparse

    from graph_exec.cli import run

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    run.register(sub)
    args = parser.parse_args(
        ["run", "embed_lm", "--ranks", "4", "--dp", "2", "--nodes", "2", "--node-rank", "1"]
    )
    job = run.job_from_args(args, parser)
    assert (job.dp, job.pp, job.micro, job.batch, job.nodes) == (2, 2, 4, 16, 2)
    assert job.plan_config(job.runs[0]).pp == 2
    assert "4 ranks (dp=2 x pp=2, 2 nodes)" in run.describe(job)
    assert jobs.nodes_of(args, parser) == Nodes(2, 1, "127.0.0.1", None)


def test_multi_node_launch_passes_msruns_own_flags(monkeypatch, tmp_path):
    from graph_exec import launch as launcher

    seen: list[list[str]] = []

    class Done:
        returncode = 0
        pid = 2**30  # above any pid: the launcher's clean-up finds no such process group

        def __init__(self, cmd, **kwargs):
            seen.append(cmd)

        def poll(self):
            return 0

        def wait(self):
            return 0

    monkeypatch.setattr(launcher.subprocess, "Popen", Done)
    monkeypatch.setattr(launcher, "msrun_executable", lambda: "msrun")
    script = tmp_path / "w.py"
    script.write_text("")  # launch() refuses a script that is not there before msrun starts
    launcher.launch(script, nproc=4, log_dir=tmp_path, timeout_s=5, nodes=Nodes(2, 1, "10.0.0.5", 9000))
    assert seen[0][:2] == [launcher.sys.executable, "-c"]  # node 1 never starts the rendezvous
    assert seen[0][3:8] == [
        "--worker_num=4",
        "--local_worker_num=2",
        "--master_addr=10.0.0.5",
        "--master_port=9000",
        "--node_rank=1",
    ]
    launcher.launch(script, nproc=2, log_dir=tmp_path, timeout_s=5, nodes=Nodes(2, 0))
    assert seen[1][0] == "msrun" and "--master_port=8118" in seen[1] and "--node_rank=0" in seen[1]
    launcher.launch(script, nproc=2, log_dir=tmp_path, timeout_s=5)
    assert "--local_worker_num=2" in seen[2] and not any(a.startswith("--node_rank") for a in seen[2])
    with pytest.raises(ValueError, match="node rank 2 is outside"):
        Nodes(2, 2)


# -- schedules ------------------------------------------------------------------------------------


def _one_process_schedule(mesh=None, **options):
    from tests.models.common import loss_fn
    from tests.models.pipeline import build

    model = build(2, "trainable")
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(model.stages)]
    return ge.ScheduleMPipeTranspose(stages, 2, model.preprocess, 1, loss_fn=loss_fn, mesh=mesh, **options)


def test_one_process_mesh_is_todays_single_process_pipeline():
    from tests.models.pipeline import batch

    x, labels = batch(4)
    plain, meshed = _one_process_schedule(), _one_process_schedule(ge.DeviceMesh())
    plain_losses, meshed_losses = plain.run(x, labels=labels), meshed.run(x, labels=labels)
    assert [float(a.asnumpy()) for a in plain_losses] == [float(b.asnumpy()) for b in meshed_losses]
    for name, grad in plain.grads().items():
        np.testing.assert_array_equal(meshed.grads()[name].asnumpy(), grad.asnumpy(), err_msg=name)
    assert "data_parallel" not in meshed.stats()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"mesh": "dp=2"}, TypeError, "mesh must be a graph_exec.DeviceMesh or None, got str"),
        ({"dp_bucket_bytes": 0}, ValueError, "dp_bucket_bytes must be a positive int, got 0"),
    ],
)
def test_bad_mesh_options_are_named(options, error, message):
    with pytest.raises(error, match=message):
        _one_process_schedule(**options)
