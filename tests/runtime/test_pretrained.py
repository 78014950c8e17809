"""Pretrained directories in, one directory out: ``load_split`` and ``export_pretrained`` on one process.

The directories are written by ``graph_exec.examples.make_pretrained`` (mindone's own
``save_pretrained``, then rewritten in BF16 as the Hub ships them: two shards and an index). The reference is the whole mindone model
loaded by mindone's ``from_pretrained`` from the same directory, run by its own ``construct``
under ``value_and_grad`` per micro-batch. Two ranks: tests/multirank/test_pretrained.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import graph_exec as ge
import graph_exec.models as gm
from graph_exec.examples.make_pretrained import config_of, make_pretrained
from graph_exec.hub.directory import PretrainedDirectory
from tests.models import mindone_models as mm
from tests.runtime.test_mindone_models import GRID, frozen_in_reference

FAMILIES = ("llama", "qwen2", "qwen2vl")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """float32 directories, for the comparisons with mindone's from_pretrained: of a BF16
    Qwen2-VL directory it loads the same parameter values, yet its loss was 2.9e-6 off (not so
    from float32), so the reference of a BF16 directory is the float32 directory of its widened
    values (test_first_step_from_bf16_equals_the_float32_reference)."""
    root = tmp_path_factory.mktemp("pretrained")
    return {name: make_pretrained(name, root / name, seed=3, dtype="float32") for name in FAMILIES}


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Hub's layout: BF16, two shards and an index, ``format: pt``, ``torch_dtype: bfloat16``."""
    root = tmp_path_factory.mktemp("bf16")
    return {name: make_pretrained(name, root / name, seed=3) for name in FAMILIES}


def reference(folder: Path):
    """The whole model, as mindone's ``from_pretrained`` loads it."""
    config = gm.pretrained.load_config(folder)
    return gm.model_class(config).from_pretrained(str(folder), attn_implementation="eager")


def options(name: str) -> dict:
    return {"image_grid": GRID} if name == "qwen2vl" else {}


def schedule(parts, mode: str, micro: int = 2, **extra):
    num = len(parts.stages)
    stages = [ge.PipelineStage(cell, k, num) for k, cell in enumerate(parts.stages)]
    return ge.ScheduleMPipeTranspose(
        stages,
        micro,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=mode,
        loss_fn=gm.causal_lm_loss,
        scale_grads=True,
        **extra,
    )


def tensors_of(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor as stored (BF16 as its uint16 bits)."""
    shards = PretrainedDirectory(folder)
    return {name: shards.read(name, "stored") for name in shards.tensors}


def stored_dtypes(folder: Path) -> set[str]:
    return {dtype for _, _, dtype in PretrainedDirectory(folder).tensors.values()}


#: Files of a Hub directory that are not weights, as an export must carry them over.
NON_WEIGHTS = {
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"chat_template": "{{ messages }}"}',
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "preprocessor_config.json": '{"min_pixels": 3136}',
    "generation_config.json": '{"eos_token_id": 2}',
}


def with_non_weights(source: Path, folder: Path) -> Path:
    """A copy of ``source`` with a tokenizer, processor config, chat template and generation config."""
    shutil.copytree(source, folder)
    for name, text in NON_WEIGHTS.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize(
    ("name", "mode"),
    [("llama", "pynative"), ("qwen2", "pynative"), ("qwen2vl", "pynative"), ("llama", "graph")],
)
def test_pipeline_from_a_directory_matches_from_pretrained(pretrained, name, mode):
    """First step's losses and every gradient: pynative exactly, graph mode to 1e-6. Qwen2 is
    tied: the embedding's and the head copy's gradients add up to the tied one (to 1e-7: the
    reference adds the two contributions inside one backward, in another order)."""
    parts = gm.load_split(pretrained[name], 4, **options(name))
    ref = reference(pretrained[name])
    frozen_in_reference(ref, parts)
    sched = schedule(parts, mode)
    inputs, labels = mm.batch(name, ref, 4)
    ref_losses, ref_grads = mm.reference(name, ref, inputs, labels, 2, scale=0.5)
    losses = [float(x.asnumpy()) for x in sched.run(*inputs, labels=labels)]
    tol = {"atol": 0, "rtol": 0} if mode == "pynative" else {"atol": 1e-6, "rtol": 1e-5}
    np.testing.assert_allclose(losses, ref_losses, **tol)
    grads = {k: v.asnumpy() for k, v in sched.grads().items()}
    tied = None
    if parts.tied_weights is not None:
        tied, head = parts.tied_weights
        grads[tied] = grads[tied] + grads.pop(head)
    assert set(grads) == set(ref_grads)
    for key, grad in grads.items():
        limits = {"atol": 1e-7, "rtol": 0} if key == tied else tol
        np.testing.assert_allclose(grad, ref_grads[key], err_msg=key, **limits)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_rank_gets_data_only_for_what_it_holds(pretrained, name):
    """At pp=2 a rank's chunks and the preprocess have the file's values; the other rank's
    weights stay initializers (no data), all but the norms' small constant vectors."""
    ref = {p.name: p for p in reference(pretrained[name]).get_parameters()}
    for rank in range(2):
        parts = gm.load_split(pretrained[name], 4, rank=rank, pp=2, **options(name))
        held = [parts.stages[s] for s in (rank, rank + 2)] + [parts.preprocess]
        mine = {id(p): p for cell in held for p in cell.get_parameters()}
        for param in mine.values():
            source = (
                parts.tied_weights[0] if parts.tied_weights and param.name == parts.tied_weights[1] else None
            )
            np.testing.assert_array_equal(
                param.asnumpy(), ref[source or param.name].asnumpy(), err_msg=param.name
            )
        others = [
            p for s in (1 - rank, 3 - rank) for p in parts.stages[s].get_parameters() if id(p) not in mine
        ]
        assert others
        unallocated = sum(int(p.size) for p in others if p.has_init)
        assert unallocated >= 0.98 * sum(int(p.size) for p in others)


def test_a_config_gives_every_rank_the_same_seeded_values():
    config = config_of("qwen2")  # tied: the head copy equals the embedding
    whole = gm.load_split(config, 4, seed=7)
    values = {
        p.name: p.asnumpy() for cell in [whole.preprocess, *whole.stages] for p in cell.get_parameters()
    }
    embed, head = whole.tied_weights
    np.testing.assert_array_equal(values[embed], values[head])
    for rank in range(2):
        parts = gm.load_split(config, 4, seed=7, rank=rank, pp=2)
        for cell in [parts.preprocess, parts.stages[rank], parts.stages[rank + 2]]:
            for param in cell.get_parameters():
                np.testing.assert_array_equal(param.asnumpy(), values[param.name], err_msg=param.name)
    other = gm.load_split(config, 4, seed=8)
    assert not np.array_equal(other.preprocess.embed.embedding_table.asnumpy(), values[embed])
    assert float(np.std(values[embed])) > 0  # drawn, not left as zeros


@pytest.mark.parametrize(("name", "dtype"), [(n, "float32") for n in FAMILIES] + [("qwen2vl", "stored")])
def test_load_then_export_reproduces_the_directory_bit_for_bit(bf16, tmp_path, name, dtype):
    """A BF16 directory, loaded as exact float32 (the CPU default) or kept in BF16, then
    exported untrained: the same tensors, bit for bit, in BF16, and the same non-weight files."""
    source_dir = with_non_weights(bf16[name], tmp_path / "in")
    source = tensors_of(source_dir)
    assert stored_dtypes(source_dir) == {"BF16"}
    parts = gm.load_split(source_dir, 2, dtype=dtype, **options(name))
    held = {str(p.dtype) for p in parts.stages[0].get_parameters()}
    assert held == ({"Float32"} if dtype == "float32" else {"BFloat16"})
    out = gm.export_pretrained(parts, tmp_path / "out", max_shard_size=100_000)
    exported = tensors_of(out)
    assert sorted(exported) == sorted(source)
    assert stored_dtypes(out) == {"BF16"}
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].shape == value.shape, key
        assert exported[key].tobytes() == value.tobytes(), key
    for file, text in NON_WEIGHTS.items():
        assert (out / file).read_text() == text, file
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    from safetensors import safe_open

    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), framework="np") as handle:
            assert handle.metadata() == {"format": "pt"}
    config = json.loads((out / "config.json").read_text())
    # At the top level, for every family (PyTorch transformers' from_pretrained reads it there).
    assert config["architectures"] == [gm.pretrained.MODEL_CLASSES[parts.family]]
    assert config["dtype"] == "bfloat16"
    assert not list(tmp_path.glob(".out.*"))  # the temporary directory was renamed
    again = reference(out)  # mindone reads the export back
    if parts.tied_weights:
        assert again.lm_head.weight is again.model.embed_tokens.embedding_table


@pytest.mark.parametrize("name", FAMILIES)
def test_make_pretrained_writes_the_hubs_layout(bf16, pretrained, name):
    """BF16 (float32 when asked), two shards and an index, ``format: pt``, ``torch_dtype``."""
    from safetensors import safe_open

    for folder, dtype, stored in ((bf16[name], "bfloat16", "BF16"), (pretrained[name], "float32", "F32")):
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors_of(folder).values())
        assert stored_dtypes(folder) == {stored}
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype
        for shard in shards:
            with safe_open(str(folder / shard), framework="np") as handle:
                assert handle.metadata() == {"format": "pt"}
    from graph_exec.hub.dtypes import float32_to_bfloat16

    bits = tensors_of(bf16[name])
    for key, value in tensors_of(pretrained[name]).items():  # the same seed: BF16 is float32 rounded
        assert float32_to_bfloat16(value).tobytes() == bits[key].tobytes(), key
        widened = (bits[key].astype(np.uint32) << 16).view(np.float32)
        assert np.abs(widened - value).max() <= np.abs(value).max() * 2**-8, key


def test_bf16_shards_read_as_mindspore_reads_them(bf16):
    """An independent reader: MindSpore's own safetensors loader gives the same BF16 bits."""
    import mindspore as ms

    shards = PretrainedDirectory(bf16["llama"])
    for file in sorted({f for f, _, _ in shards.tensors.values()}):
        theirs = ms.load_checkpoint(str(bf16["llama"] / file), format="safetensors")
        for name, tensor in theirs.items():
            assert tensor.dtype == ms.bfloat16, name
            np.testing.assert_array_equal(
                shards.read(name), tensor.astype(ms.float32).asnumpy(), err_msg=name
            )
            assert shards.read(name, "stored").tobytes() == tensor.asnumpy().view(np.uint16).tobytes()


@pytest.mark.parametrize("name", ["llama", "qwen2vl"])
def test_first_step_from_bf16_equals_the_float32_reference(bf16, tmp_path, name):
    """The BF16 directory and a float32 one holding the same (widened) values give the same
    first step: losses and every gradient equal exactly (the parameters are equal bit for bit)."""
    from graph_exec.examples.make_pretrained import set_dtype

    wide = tmp_path / "f32"
    shutil.copytree(bf16[name], wide)
    set_dtype(wide, "float32")
    assert stored_dtypes(wide) == {"F32"}
    results = []
    for folder in (bf16[name], wide):
        parts = gm.load_split(folder, 4, **options(name))
        sched = schedule(parts, "pynative")
        inputs, labels = mm.batch(name, parts.model, 4)
        losses = [float(x.asnumpy()) for x in sched.run(*inputs, labels=labels)]
        results.append((losses, {k: v.asnumpy() for k, v in sched.grads().items()}))
    (losses, grads), (ref_losses, ref_grads) = results
    assert losses == ref_losses
    assert set(grads) == set(ref_grads)
    for key, grad in grads.items():
        np.testing.assert_array_equal(grad, ref_grads[key], err_msg=key)


def test_export_dtype_chooses_what_is_written(bf16, tmp_path):
    """float32: the exact widened values; float16: numpy's rounding of them; a float32
    directory exports float32 by default (its torch_dtype); a bad dtype is named."""
    source = tensors_of(bf16["llama"])
    parts = gm.load_split(bf16["llama"], 2)
    wide = gm.export_pretrained(parts, tmp_path / "f32", dtype="float32")
    half = gm.export_pretrained(parts, tmp_path / "f16", dtype="float16")
    assert stored_dtypes(wide) == {"F32"} and stored_dtypes(half) == {"F16"}
    assert json.loads((wide / "config.json").read_text())["dtype"] == "float32"
    for key, bits in source.items():
        exact = (bits.astype(np.uint32) << 16).view(np.float32)
        wide_value = PretrainedDirectory(wide).read(key, "stored")
        assert wide_value.dtype == np.float32 and wide_value.tobytes() == exact.tobytes(), key
        assert PretrainedDirectory(half).read(key, "stored").tobytes() == exact.astype(np.float16).tobytes()
    again = gm.load_split(wide, 2)
    assert stored_dtypes(gm.export_pretrained(again, tmp_path / "default")) == {"F32"}
    with pytest.raises(
        ValueError, match=r"export dtype 'int8' is not a dtype an export writes; choose one of float32"
    ):
        gm.export_pretrained(parts, tmp_path / "bad", dtype="int8")


def test_trained_export_gives_the_pipelines_logits(pretrained, tmp_path):
    """One Adam step, export, from_pretrained: its logits equal the pipeline's ``evaluate``."""
    parts = gm.load_split(pretrained["llama"], 2)
    sched = schedule(parts, "pynative")
    inputs, labels = mm.batch("llama", None, 4)
    sched.run(*inputs, labels=labels)
    sched.step(__import__("mindspore").nn.Adam(sched.trainable_params(), learning_rate=1e-2))
    out = gm.export_pretrained(parts, tmp_path / "trained", dtype="float32")  # the trained values exactly
    evaluated = sched.evaluate(*inputs)
    mine = np.concatenate([x.asnumpy() for x in evaluated])
    theirs = mm.logits_of("llama", reference(out), inputs).asnumpy()
    np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=0)
    before = mm.logits_of("llama", reference(pretrained["llama"]), inputs).asnumpy()
    assert np.abs(before - theirs).max() > 1e-4  # the step changed the weights


def test_export_refuses_a_non_empty_directory_unless_overwrite(pretrained, tmp_path):
    parts = gm.load_split(pretrained["llama"], 2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "note.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"exists and is not empty.*overwrite=True"):
        gm.export_pretrained(parts, out)
    assert (out / "note.txt").read_text() == "mine"
    gm.export_pretrained(parts, out, overwrite=True)
    assert not (out / "note.txt").exists() and (out / "config.json").is_file()


def test_export_refuses_tied_copies_that_differ(pretrained, tmp_path):
    """The export writes the embedding only: a head copy that drifted from it would be lost, so
    the export refuses, naming both copies, and writes nothing."""
    from mindspore import ops

    name = next(n for n in FAMILIES if gm.load_split(pretrained[n], 2).tied_weights)
    parts = gm.load_split(pretrained[name], 2)
    embed, head = parts.tied_weights
    param = next(p for cell in parts.stages for p in cell.get_parameters() if p.name == head)
    ops.assign(param, param * 1.001)
    with pytest.raises(ValueError, match=rf"tied copies {embed!r} .* and {head!r} .* hold different values"):
        gm.export_pretrained(parts, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing_from_pretrained_accepts(pretrained, tmp_path, monkeypatch):
    from graph_exec.models import export

    parts = gm.load_split(pretrained["llama"], 2)
    calls = []

    def dies(folder, file, names, params, **kwargs):
        calls.append(file)
        if len(calls) == 2:
            raise OSError("disk full")
        return original(folder, file, names, params, **kwargs)

    original = export.write_shard
    monkeypatch.setattr(export, "write_shard", dies)
    with pytest.raises(RuntimeError, match=r"failed on pipeline rank 0.*disk full"):
        gm.export_pretrained(parts, tmp_path / "out", max_shard_size=100_000)
    assert list(tmp_path.iterdir()) == []


def broken_copy(source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder)
    return folder


def rewrite_shard(folder: Path, change) -> None:
    """Rewrite the shard holding ``model.norm.weight`` with ``change(tensors)`` applied."""
    from safetensors.numpy import save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["model.norm.weight"]
    shards = PretrainedDirectory(folder)
    tensors = {k: shards.read(k) for k, (f, _, _) in shards.tensors.items() if f == file}
    save_file(change(tensors), str(folder / file))


def test_bad_directories_are_named_before_anything_is_built(pretrained, tmp_path):
    missing_shard = broken_copy(pretrained["llama"], tmp_path / "a")
    next(missing_shard.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match=r"missing shard\(s\) \['model-00002-of-0000"):
        gm.load_split(missing_shard, 2)
    missing_tensor = broken_copy(pretrained["llama"], tmp_path / "b")
    rewrite_shard(missing_tensor, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})
    index = json.loads((missing_tensor / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (missing_tensor / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) the model needs: \['model.norm.weight'\]"):
        gm.load_split(missing_tensor, 2)
    wrong_shape = broken_copy(pretrained["llama"], tmp_path / "c")
    rewrite_shard(wrong_shape, lambda t: {**t, "model.norm.weight": np.ones(63, np.float32)})
    with pytest.raises(ValueError, match=r"model.norm.weight: \[63\] in the file, \[64\] from the config"):
        gm.load_split(wrong_shape, 2)
    unknown = broken_copy(pretrained["llama"], tmp_path / "d")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(
        TypeError, match="model_type 'gpt2' is not a family the split knows; choose one of llama"
    ):
        gm.load_split(unknown, 2)
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        gm.load_split(tmp_path / "nowhere", 2)


def test_bad_ranks_are_named(pretrained):
    with pytest.raises(ValueError, match=r"rank 2 is not a pipeline rank of pp=2: choose 0 … 1"):
        gm.load_split(pretrained["llama"], 4, rank=2, pp=2)
    with pytest.raises(ValueError, match="num_stages=3 is not a multiple of pp=2"):
        gm.load_split(pretrained["llama"], 3, rank=0, pp=2)
    with pytest.raises(ValueError, match="pp must be an integer >= 1"):
        gm.load_split(pretrained["llama"], 4, pp=0)


@pytest.mark.parametrize("name", ["qwen2", "qwen2vl"])
def test_offline_export_of_a_checkpoint_equals_the_live_export(pretrained, tmp_path, name, capsys):
    """``graph-exec export`` of a saved step writes what ``export_pretrained`` writes live, with
    the non-weight files of --config-from; ``--export-dtype bfloat16`` rounds the same values."""
    import mindspore as ms

    from graph_exec.cli import main
    from graph_exec.hub.dtypes import float32_to_bfloat16

    source = with_non_weights(pretrained[name], tmp_path / "in")
    parts = gm.load_split(source, 2, **options(name))
    # trained as one weight: an export refuses tied copies that differ
    sched = schedule(parts, "pynative", tied_parameters=parts.tied_weights)
    inputs, labels = mm.batch(name, parts.model, 4)
    sched.run(*inputs, labels=labels)
    optimizer = ms.nn.Adam(sched.trainable_params(), learning_rate=1e-2)
    sched.step(optimizer)
    ge.save_checkpoint(sched, tmp_path / "ckpt", 1, optimizer=optimizer)
    live = gm.export_pretrained(parts, tmp_path / "live")
    argv = [
        "export",
        str(tmp_path / "ckpt"),
        "--config-from",
        str(source),
        "--out",
        str(tmp_path / "off"),
    ]
    assert main(argv) == 0
    assert "exported to" in capsys.readouterr().out
    for file, text in NON_WEIGHTS.items():
        assert (live / file).read_text() == text and (tmp_path / "off" / file).read_text() == text, file
    assert main([*argv[:-1], str(tmp_path / "bf16"), "--export-dtype", "bfloat16"]) == 0
    rounded = tensors_of(tmp_path / "bf16")
    assert all(rounded[k].tobytes() == float32_to_bfloat16(v).tobytes() for k, v in tensors_of(live).items())
    a, b = tensors_of(live), tensors_of(tmp_path / "off")
    assert sorted(a) == sorted(b) == sorted(tensors_of(pretrained[name]))
    assert all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)
    assert any(a[k].tobytes() != v.tobytes() for k, v in tensors_of(pretrained[name]).items())  # trained
    reference(tmp_path / "off")  # mindone reads it
    with pytest.raises(SystemExit):
        main(argv)  # --out is not empty now
    assert "exists and is not empty" in capsys.readouterr().err
    rank_file = next((tmp_path / "ckpt" / "step_1").glob("rank_*.ckpt"))
    rank_file.write_bytes(rank_file.read_bytes()[:-8] + b"corrupt!")
    assert main([*argv[:-1], str(tmp_path / "again")]) == 1
    assert "does not match its checksum" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_examples_build_from_a_directory(pretrained):
    """What ``graph-exec run llama|qwen2vl --pretrained DIR`` builds on a rank: its share, the
    directory's values, the batches of the example."""
    from graph_exec.examples import llama, qwen2vl

    built = llama.build(4, pretrained=str(pretrained["qwen2"]), rank=1, pp=2)
    assert built.split.rank == 1 and built.split.family == "qwen2" and "from" in built.summary
    head = built.stages[3].head.weight
    np.testing.assert_array_equal(
        head.asnumpy(), tensors_of(pretrained["qwen2"])["model.embed_tokens.weight"]
    )
    assert all(p.has_init for p in built.stages[0].blocks.get_parameters() if p.name.endswith("proj.weight"))
    inputs, labels = built.batch(0, 4)
    assert inputs[0].shape == labels.shape == (4, llama.SEQ)
    vision = qwen2vl.build(2, pretrained=str(pretrained["qwen2vl"]))
    inputs, _ = vision.batch(0, 2)
    assert tuple(inputs[0].shape) == (2, 16, 96)
    with pytest.raises(ValueError, match=r"takes a Llama or Qwen2 directory.*holds qwen2_vl"):
        llama.build(4, pretrained=str(pretrained["qwen2vl"]))


def test_float32_to_bfloat16_rounds_as_mindspore_does():
    """Round to nearest, ties to even, against MindSpore's own cast; NaN stays NaN (its sign
    kept), infinities and values past the largest BF16 as MindSpore makes them."""
    import mindspore as ms

    from graph_exec.hub.dtypes import bfloat16_to_float32, float32_to_bfloat16

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 1000, dtype=np.uint32) << 16) | np.uint32(0x8000)  # exactly halfway
    special = np.array(
        [0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x7F7F8000], np.uint32
    )
    values = np.concatenate([bits, ties, special]).view(np.float32)
    finite = ~np.isnan(values)
    theirs = ms.Tensor(values[finite], ms.bfloat16).asnumpy().view(np.uint16)
    np.testing.assert_array_equal(float32_to_bfloat16(values[finite]), theirs)
    nans = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    back = bfloat16_to_float32(float32_to_bfloat16(nans))
    assert np.isnan(back).all() and list(np.signbit(back)) == [False, True, False, False]


def test_a_dtype_the_reader_cannot_read_is_named(tmp_path):
    from graph_exec.hub.dtypes import write_safetensors

    write_safetensors(
        tmp_path / "model.safetensors",
        {"w": ("F8_E4M3", np.zeros((2, 2), np.uint8)), "v": ("F32", np.ones(2, np.float32))},
        {"format": "pt"},
    )
    shards = PretrainedDirectory(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"tensor 'w' is stored as F8_E4M3, which cannot be read; readable: F64, F32, F16, BF16",
    ):
        shards.read("w")
    with pytest.raises(ValueError, match=r"tensor 'w' is stored as F8_E4M3"):
        shards.resolve({"a": (("w",), (2, 2))})
    with pytest.raises(ValueError, match=r"dtype must be one of float32, stored, got 'bf16'"):
        shards.read("v", "bf16")


_READ_PEAK = """
import sys
from graph_exec.hub.directory import PretrainedDirectory

def peak_mib():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) / 1024

shards = PretrainedDirectory(sys.argv[1])
before = peak_mib()
value = shards.read("big", sys.argv[2])
print(peak_mib() - before, value.nbytes / 2**20, float(value[3, 5]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc (Linux)")
@pytest.mark.parametrize(("stored", "dtype"), [("F32", "stored"), ("BF16", "float32"), ("F16", "float32")])
def test_reading_a_tensor_holds_it_once(tmp_path, stored, dtype):
    """A rank's peak memory holds a tensor it reads once, not twice (the mapped file's pages
    and a copy, which safetensors' get_tensor holds at the moment of the read): a 64 MiB
    float32 tensor read in a fresh process raises its peak by at most 1.1 x 64 MiB, whether the
    file holds it in float32 or in BF16/F16 widened on the way in."""
    import subprocess
    import sys

    from graph_exec.hub.dtypes import as_stored, write_safetensors

    big = (np.arange(2**24, dtype=np.float32) % 251 - 125).reshape(4096, 4096)  # exact in every dtype
    tensors = {"big": as_stored(big, stored), "small": ("F32", np.ones(3, np.float32))}
    write_safetensors(tmp_path / "model.safetensors", tensors, {"format": "pt"})
    done = subprocess.run(
        [sys.executable, "-c", _READ_PEAK, str(tmp_path), dtype], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    grew, size, value = (float(v) for v in done.stdout.split())
    assert size == 64 and value == big[3, 5]
    assert grew <= 1.1 * size, f"reading a {size:.0f} MiB tensor raised the peak by {grew:.0f} MiB"


def test_a_bf16_or_f16_tensor_widens_exactly_across_chunks(tmp_path, monkeypatch):
    """Widening in place runs in chunks: with a chunk of 7 elements, every value still comes
    out exact (a chunk that overwrote a source still unread would show here)."""
    from graph_exec.hub import dtypes

    monkeypatch.setattr(dtypes, "_CHUNK", 7)
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**16, (13, 11), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # no NaN / inf: compared by value
    half = rng.standard_normal((5, 9)).astype(np.float16)
    dtypes.write_safetensors(
        tmp_path / "model.safetensors", {"b": ("BF16", bits), "h": ("F16", half)}, {"format": "pt"}
    )
    shards = PretrainedDirectory(tmp_path)
    np.testing.assert_array_equal(shards.read("b"), dtypes.bfloat16_to_float32(bits))
    np.testing.assert_array_equal(shards.read("h"), half.astype(np.float32))
    assert shards.read("b", "stored").tobytes() == bits.tobytes()


def test_a_shard_cut_short_after_it_was_opened_is_named(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones((64, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    shards = PretrainedDirectory(tmp_path)  # checked whole here
    with open(tmp_path / "model.safetensors", "r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 100)
    with pytest.raises(ValueError, match=r"holds 16284 of the 16384 bytes of tensor 'w'"):
        shards.read("w")
