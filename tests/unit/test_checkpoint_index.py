"""A checkpoint's index and loading by name under another plan, without MindSpore or msrun:
which file each rank reads each tensor from, what is refused (naming it), and what
``graph-exec run --resume`` says and refuses before the launch when the plan changed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graph_exec.checkpoint import index, layout
from graph_exec.cli import main
from tests.unit.test_checkpoint_layout import checksummed_step, launched, no_launch, run_argv, run_facts

__all__ = ["launched", "no_launch"]  # fixtures used here


def tensor(*shape: int, dtype: str = "Float32") -> SimpleNamespace:
    return SimpleNamespace(shape=shape, dtype=dtype)


def saved_by_two_ranks() -> dict:
    """A (P = 2) checkpoint: the preprocess ``pre.w`` and Adam's step on both ranks, a block each."""
    ranks = []
    for rank in (0, 1):
        model = {"pre.w": tensor(4, 2), f"lm.blocks.{rank}.w": tensor(2, 2)}
        state = {"beta1_power": tensor(), **{f"moment1.{n}": tensor(*v.shape) for n, v in model.items()}}
        listing = {**index.listing(model, "model"), **index.listing(state, "optimizer")}
        ranks.append({"file": f"rank_{rank}.ckpt", "listing": listing})
    return index.build(ranks)


def test_the_index_lists_every_copy_of_a_name_lowest_rank_first():
    saved = saved_by_two_ranks()
    assert saved["pre.w"] == {
        "shape": [4, 2],
        "dtype": "Float32",
        "kind": "model",
        "files": ["rank_0.ckpt", "rank_1.ckpt"],
    }
    assert saved["lm.blocks.1.w"]["files"] == ["rank_1.ckpt"]
    assert saved["moment1.lm.blocks.0.w"]["kind"] == "optimizer"


def test_copies_of_one_name_that_disagree_are_refused_naming_both_files():
    ranks = [
        {"file": "rank_0.ckpt", "listing": index.listing({"pre.w": tensor(4, 2)}, "model")},
        {"file": "rank_1.ckpt", "listing": index.listing({"pre.w": tensor(4, 3)}, "model")},
    ]
    with pytest.raises(ValueError, match=r"'pre.w' is saved as \[4, 2\].*rank_0.ckpt.*\[4, 3\].*rank_1.ckpt"):
        index.build(ranks)


def test_one_rank_now_holding_everything_reads_each_name_from_the_file_that_holds_it():
    saved = saved_by_two_ranks()
    live = {n: tensor(*f["shape"]) for n, f in saved.items() if f["kind"] == "model"}
    extra = {n: tensor(*f["shape"]) for n, f in saved.items() if f["kind"] == "optimizer"}
    wanted = {**index.want(live, "model"), **index.want(extra, "optimizer")}
    plan, problems = index.resolve(saved, wanted, own_file=None)
    assert problems == []
    assert sorted(plan["rank_1.ckpt"]) == ["lm.blocks.1.w", "moment1.lm.blocks.1.w"]
    assert "pre.w" in plan["rank_0.ckpt"]  # a replicated tensor from one copy: the first


def test_a_rank_prefers_its_own_old_file_so_a_same_plan_load_opens_only_it():
    saved = saved_by_two_ranks()
    wanted = index.want({"pre.w": tensor(4, 2), "lm.blocks.1.w": tensor(2, 2)}, "model")
    assert index.resolve(saved, wanted, own_file="rank_1.ckpt") == (
        {"rank_1.ckpt": ["lm.blocks.1.w", "pre.w"]},
        [],
    )


def test_another_model_and_missing_optimizer_state_are_named():
    saved = saved_by_two_ranks()
    wanted = {
        **index.want({"lm.blocks.0.w": tensor(2, 3), "lm.blocks.7.w": tensor(2, 2)}, "model"),
        **index.want({"moment2.lm.blocks.0.w": tensor(2, 3)}, "optimizer"),
    }
    plan, problems = index.resolve(saved, wanted, own_file="rank_0.ckpt")
    assert plan == {}
    assert problems[0] == (
        "model parameters not in the checkpoint (written for another model?): lm.blocks.7.w"
    )
    assert "lm.blocks.0.w: checkpoint has (2, 2) Float32, this rank has (2, 3) Float32" in problems
    assert problems[-1] == (
        "optimizer state missing from the checkpoint: moment2.lm.blocks.0.w (for lm.blocks.0.w)"
    )


def test_parameters_no_rank_claims_are_found():
    saved = saved_by_two_ranks()
    assert index.unclaimed(saved, ["pre.w", "lm.blocks.0.w"]) == ["lm.blocks.1.w"]
    assert index.parameter_of("moment1.lm.blocks.0.w") == "lm.blocks.0.w"
    assert index.parameter_of("beta1_power") is None


# -- graph-exec run --resume under another plan ------------------------------------------------


def indexed_step(directory, step: int, *argv: str) -> None:
    """A checkpoint of ``graph-exec run embed_lm *argv`` (default: 2 ranks, V = 2, batch 8) with
    an index."""
    folder = checksummed_step(directory, step)
    manifest = layout.read_manifest(directory, step)
    manifest.update(run_facts(*argv))
    manifest["index"] = saved_by_two_ranks()
    layout.write_json_atomically(folder / layout.MANIFEST, manifest)


def test_a_resume_on_another_plan_says_what_changed_and_launches(tmp_path, capsys, launched):
    indexed_step(tmp_path, 3)
    argv = run_argv(tmp_path, "--resume", "--ranks", "4", "--vpp", "1", "--layers", "2,1,1,0", "--batch", "8")
    argv += ["--micro", "4"]  # the default M follows --ranks; a resume keeps the checkpoint's
    assert main(argv) == 7
    (job,) = launched
    assert job.first_step == 3 and job.ranks == 4 and job.runs[0].layers == (2, 1, 1, 0)
    err = capsys.readouterr().err
    assert "checkpoint step 3 was written under another plan, resuming by name:" in err, err
    for said in (
        "world size (--ranks): checkpoint 2, this job 4",
        "V (stages per rank) (--vpp): checkpoint 2, this job 1",
        "split (--layers): checkpoint even, this job 2,1,1,0",
    ):
        assert said in err, err


@pytest.mark.parametrize(("saved", "now"), [("1", "0"), ("0", "1")])
def test_a_resume_with_zero_switched_says_so_and_launches(tmp_path, capsys, launched, saved, now):
    """ZeRO-1 only moves optimizer state between replicas: a checkpoint with an index resumes
    with ``--zero`` switched either way (the ranks read the moments by name), said, nothing else
    changed; without an index it is refused (tests/unit/test_checkpoint_layout.py)."""
    mesh = ("--dp", "2", "--batch", "8")
    indexed_step(tmp_path, 3, *mesh, "--zero", saved)
    assert main(run_argv(tmp_path, "--resume", *mesh, "--zero", now)) == 7
    (job,) = launched
    assert job.first_step == 3 and job.runs[0].optimizer_sharding is (now == "1")
    err = capsys.readouterr().err
    said = f"option optimizer_sharding (--zero): checkpoint {saved == '1'}, this job {now == '1'}"
    assert f"checkpoint step 3 was written under another plan, resuming by name: {said}\n" in err, err


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch", "16"], "global batch (--batch): checkpoint 8, this job 16"),
        (
            ["--batch", "8", "--frozen"],
            "preprocess (--frozen/--trainable): checkpoint 'trainable', this job 'frozen'",
        ),
        # the micro-batches' gradients are summed: another M scales them against Adam's moments
        (["--batch", "8", "--micro", "2"], "option micro_batch_num (--micro): checkpoint 4, this job 2"),
    ],
)
def test_what_cannot_carry_over_exits_2_before_launching(tmp_path, capsys, extra, message):
    indexed_step(tmp_path, 3)
    with pytest.raises(SystemExit) as exc:
        main(run_argv(tmp_path, "--resume", "--ranks", "4", *extra))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["run", "embed_lm", "--ranks", "2", "--layers", "2,2"],
            "--layers 2,2 gives 2 stages, this job has P x V = 2 x 2",
        ),
        (["run", "vl_tower", "--layers", "1,1,1,1"], "--layers needs an example with a per-stage split"),
    ],
)
def test_a_split_that_cannot_apply_exits_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
