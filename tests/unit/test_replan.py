"""Re-planning a job on fewer ranks (``--min-ranks``), without launching anything.

The plan kept must load the same checkpoint by name: the same stage count ``P x V``, split and
global batch, on the most ranks the host has (at least ``--min-ranks``). The usable-rank probe
reads device files and the visible-devices list; bad ``--min-ranks`` values exit with code 2
before msrun could start (the launcher is a tripwire here).
"""

from __future__ import annotations

import dataclasses

import pytest

import graph_exec.launch as launch_module
from graph_exec import device
from graph_exec.cli import jobs, main
from graph_exec.cli.run import on_usable_ranks
from graph_exec.replan import ReplanError, layout, plan_on, plan_on_fewer
from graph_exec.report.job import JobSpec, RunSpec


def job(ranks: int = 4, dp: int = 2, vpp: int = 2, micro: int = 4, batch: int = 16, **run) -> JobSpec:
    spec = RunSpec(name="run", mode="graph", trainable=True, **run)
    return JobSpec(
        example="embed_lm", size="tiny", ranks=ranks, vpp=vpp, micro=micro, batch=batch, steps=5,
        warmup=1, runs=(spec,), dp=dp, first_step=3, checkpoint_dir="ckpt",
    )  # fmt: skip


def test_four_ranks_on_two_keep_the_stages_the_batch_and_the_micro_batch_count():
    planned = plan_on(job(), 2)
    assert (planned.ranks, planned.dp, planned.pp, planned.vpp) == (2, 1, 2, 2)
    assert planned.pp * planned.vpp == 4 and planned.batch == 16
    assert planned.micro == 4  # the gradient's scale (a sum over micro-batches) stays
    assert (planned.first_step, planned.steps, planned.checkpoint_dir) == (3, 5, "ckpt")
    assert layout(planned) == "(D=1, P=2, V=2, M=4)"


def test_the_largest_p_dividing_both_the_stages_and_the_ranks_is_chosen():
    eight = job(ranks=8, dp=1, vpp=1, micro=8, batch=16)  # 8 stages, one per rank
    assert (plan_on(eight, 4).pp, plan_on(eight, 4).vpp, plan_on(eight, 4).dp) == (4, 2, 1)
    six = plan_on(job(ranks=6, dp=1, vpp=2, micro=6, batch=12), 4)  # 12 stages: P 4 divides 12 and 4
    assert (six.dp, six.pp, six.vpp) == (1, 4, 3)


def test_the_split_is_kept_and_the_same_ranks_change_nothing():
    rebalanced = job(layers=(2, 1, 1, 0))
    assert plan_on(rebalanced, 2).runs[0].layers == (2, 1, 1, 0)
    assert plan_on(rebalanced, 4) is rebalanced


def test_a_count_no_plan_fits_is_named_with_what_was_tried():
    with pytest.raises(ReplanError) as error:
        plan_on(job(), 3)  # P must divide gcd(4, 3) = 1, and D = 3 does not divide the batch 16
    text = str(error.value)
    assert "no plan of the job's 4 stages and global batch 16 fits 3 ranks" in text
    assert "D=3 P=1 V=4: D x M = 3 x 4 does not divide the global batch 16" in text


def test_fewer_usable_ranks_take_the_most_that_fit_and_not_fewer_than_the_minimum():
    assert plan_on_fewer(job(), 3, 2).ranks == 2  # 3 fits no plan, 2 does
    assert plan_on_fewer(job(), 4, 2).ranks == 4
    with pytest.raises(ReplanError, match="only 1 rank usable, fewer than --min-ranks 2"):
        plan_on_fewer(job(), 1, 2)
    with pytest.raises(ReplanError, match="3 usable ranks \\(--min-ranks 3\\)"):
        plan_on_fewer(job(), 3, 3)


def test_a_batch_that_d_x_m_does_not_divide_leaves_that_plan_out():
    odd = job(ranks=4, dp=4, vpp=1, micro=2, batch=8)  # 1 stage, 4 replicas of 1 micro-batch row
    assert plan_on(odd, 2).dp == 2
    with pytest.raises(ReplanError, match="D=3 P=1 V=1: D x M = 3 x 2 does not divide the global batch 8"):
        plan_on(odd, 3)


def test_a_plan_the_schedule_refuses_is_skipped():
    owner = job(ranks=4, dp=2, vpp=1, micro=2, batch=8, backward="owner")  # 2 stages
    with pytest.raises(ReplanError, match="backward 'owner' needs a peer rank"):
        plan_on(owner, 1)  # P = 1 is the only plan of 2 stages on 1 rank


def test_the_probe_counts_present_devices_among_the_visible_ones(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidia3", "nvidiactl", "davinci0"):
        (tmp_path / name).touch()
    assert device.usable_ranks("GPU", {}, tmp_path) == 3
    assert device.usable_ranks("GPU", {"CUDA_VISIBLE_DEVICES": "0,2,3"}, tmp_path) == 2
    assert device.usable_ranks("Ascend", {"ASCEND_RT_VISIBLE_DEVICES": ""}, tmp_path) == 0
    assert device.usable_ranks("Ascend", {}, tmp_path) == 1
    assert device.usable_ranks("CPU", {}, tmp_path) is None


def test_a_relaunch_follows_the_usable_ranks(monkeypatch):
    original = job()
    resumed = dataclasses.replace(original, first_step=3)
    monkeypatch.setattr(device, "usable_ranks", lambda target: 2)
    planned, said = on_usable_ranks(original, resumed, 2)
    assert isinstance(planned, JobSpec) and planned.ranks == 2
    assert said == (
        "only 2 of 4 ranks usable: re-planned on 2 ranks, (D=2, P=2, V=2, M=4) -> (D=1, P=2, V=2, M=4); "
        "the 4 stages, the split and the global batch 16 are kept, the checkpoint loads by name"
    )
    refused, _ = on_usable_ranks(original, resumed, None)
    assert refused == "only 2 of the job's 4 ranks are usable (pass --min-ranks N to go on with fewer)"
    refused, _ = on_usable_ranks(original, resumed, 3)
    assert isinstance(refused, str) and "fits 2 ranks" not in refused and "only 2 ranks usable" in refused
    monkeypatch.setattr(device, "usable_ranks", lambda target: None)  # CPU: the job's own plan
    again, said = on_usable_ranks(original, dataclasses.replace(planned, first_step=4), 2)
    assert (again.ranks, again.dp, again.micro, again.first_step) == (4, 2, 4, 4)
    assert said == "all 4 ranks usable again, back to (D=2, P=2, V=2, M=4)"


def test_the_launcher_runs_each_attempt_on_the_ranks_it_is_given(monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    launched = []

    def once(script, args, nproc, *rest):
        launched.append(nproc)
        result = launch_module.LaunchResult(-9 if len(launched) == 1 else 0, False, 0.1, tmp_path, "")
        result.exits = {3: -9} if len(launched) == 1 else {}
        return result, True

    monkeypatch.setattr(launch_module, "_launch_once", once)
    result = launch_module.launch(
        script, nproc=4, log_dir=tmp_path / "logs", timeout_s=30, max_restarts=1, nproc_of=lambda a: 2
    )
    assert result.ok and launched == [4, 2]


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(jobs, "launch", lambda *a, **k: pytest.fail("msrun was launched"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-ranks", "2"], "--min-ranks 2 needs --max-restarts N"),
        (["--max-restarts", "1", "--min-ranks", "5"], "--min-ranks 5 is above --ranks 4"),
        (
            ["--max-restarts", "1", "--min-ranks", "3"],
            "--min-ranks 3: no plan of this job's 4 stages (P x V) and global batch 16 fits 3 ranks; "
            "rank counts that fit: [1, 2, 4]",
        ),
    ],
)
def test_bad_min_ranks_exit_2_before_the_launch(flags, message, no_launch, tmp_path, capsys):
    argv = ["run", "embed_lm", "--ranks", "4", "--dp", "2", "--micro", "4", "--batch", "16"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--checkpoint-dir", str(tmp_path / "ckpt"), *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
