"""graph_exec.data: shards per replica, shuffling by seed and epoch, resume position, collation
errors naming the sample, mindspore.dataset sources, owned reading."""

from __future__ import annotations

import numpy as np
import pytest

from graph_exec.data import DataError, DataLoader, SampleError
from graph_exec.schedule import PlanConfig


def samples(n: int, width: int = 3) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full((width,), i, np.float32), "y": np.int32(i)} for i in range(n)]


class Counting:
    """A map-style source that records which indices were read."""

    def __init__(self, n: int) -> None:
        self.data, self.read = samples(n), []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        self.read.append(index)
        return self.data[index]


class Rows:
    """The samples of ``data`` as ``(x, y)`` rows, for a ``GeneratorDataset``."""

    def __init__(self, data: list[dict[str, np.ndarray]]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]["x"], self.data[index]["y"]


def epoch_ids(loader: DataLoader) -> list[int]:
    return [int(v) for batch in loader for v in batch["y"]]


def test_two_replicas_read_every_sample_exactly_once_per_epoch() -> None:
    replicas = [DataLoader(samples(24), 4, dp_rank=d, dp_size=2, seed=3) for d in (0, 1)]
    for _ in range(3):  # three epochs, each a different permutation
        seen = [epoch_ids(r) for r in replicas]
        assert sorted(seen[0] + seen[1]) == list(range(24))
        assert not set(seen[0]) & set(seen[1])
        assert len(seen[0]) == len(seen[1]) == 12


def test_an_uneven_source_leaves_out_the_tail_never_repeats_and_drop_last_false_refuses() -> None:
    replicas = [DataLoader(samples(27), 4, dp_rank=d, dp_size=2) for d in (0, 1)]
    seen = [epoch_ids(r) for r in replicas]
    assert len(seen[0] + seen[1]) == len(set(seen[0] + seen[1])) == 24  # 27 mod 8 = 3 left out
    with pytest.raises(DataError, match="27 samples are not a multiple of the global batch 8"):
        DataLoader(samples(27), 4, dp_size=2, drop_last=False)


def test_shuffling_differs_per_epoch_and_repeats_per_seed() -> None:
    first = DataLoader(samples(32), 8, seed=5)
    epochs = [epoch_ids(first) for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3 and all(sorted(e) == list(range(32)) for e in epochs)
    again = DataLoader(samples(32), 8, seed=5)
    assert [epoch_ids(again) for _ in range(3)] == epochs
    assert epoch_ids(DataLoader(samples(32), 8, seed=6)) != epochs[0]
    assert epoch_ids(DataLoader(samples(32), 8, shuffle=False)) == list(range(32))


@pytest.mark.parametrize("consumed", [0, 3, 4, 9])  # 4 batches per epoch: mid-epoch, at the boundary
def test_state_dict_round_trip_continues_with_exactly_the_next_batch(consumed: int) -> None:
    original = DataLoader(samples(32), 4, dp_rank=1, dp_size=2, seed=11)
    for _ in range(consumed):
        original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch() for _ in range(6)]
    resumed = DataLoader(samples(32), 4, dp_rank=1, dp_size=2, seed=11)
    resumed.load_state_dict(dict(state))
    for want in expected:
        got = resumed.next_batch()
        np.testing.assert_array_equal(got["x"], want["x"])
        np.testing.assert_array_equal(got["y"], want["y"])


def test_a_state_from_another_set_up_is_refused_naming_the_difference() -> None:
    state = DataLoader(samples(32), 4, seed=1).state_dict()
    other = DataLoader(samples(32), 4, seed=2)
    with pytest.raises(DataError, match=r"seed 1 \(now 2\)"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="not a DataLoader state_dict"):
        other.load_state_dict({"epoch": 0})
    assert other.epoch == 0 and other.step == 0


def test_mindspore_generator_dataset_gives_the_same_batches_as_the_sequence() -> None:
    import mindspore.dataset as ds

    class Source:
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int):
            return np.full((3,), i, np.float32), np.int32(i)

    dataset = ds.GeneratorDataset(Source(), column_names=["x", "y"])
    through_mindspore = DataLoader(dataset, 4, dp_rank=0, dp_size=2, seed=4)
    plain = DataLoader(samples(16), 4, dp_rank=0, dp_size=2, seed=4)
    for _ in range(2):  # two epochs
        batches = list(through_mindspore)
        expected = list(plain)
        assert len(batches) == len(expected) == 2
        for got, want in zip(batches, expected, strict=True):
            assert set(got) == {"x", "y"}
            np.testing.assert_array_equal(got["x"], want["x"])
            np.testing.assert_array_equal(got["y"], want["y"])
    with pytest.raises(DataError, match="without num_shards"):
        DataLoader(ds.GeneratorDataset(Source(), column_names=["x", "y"], num_shards=2, shard_id=0), 2)
    with pytest.raises(DataError, match="MapDataset cannot be read by index"):
        DataLoader(dataset.map(lambda x: x, input_columns=["x"]), 2)


def test_a_sample_that_cannot_be_stacked_is_named_not_dropped() -> None:
    data = samples(8)
    data[5] = {"x": np.zeros((4,), np.float32), "y": np.int32(5)}
    loader = DataLoader(data, 8, shuffle=False)
    with pytest.raises(SampleError, match=r"sample 5 cannot be stacked.*'x' has shape \(4,\)") as info:
        loader.next_batch()
    assert info.value.index == 5
    assert loader.step == 0  # the position stays at the batch that failed
    with pytest.raises(SampleError, match="sample 5"):
        loader.next_batch()


def test_a_custom_collate_failure_names_the_sample() -> None:
    def collate(batch):
        if any(int(s["y"]) == 6 for s in batch):
            raise ValueError("unsupported image")
        return np.stack([s["x"] for s in batch])

    loader = DataLoader(samples(8), 4, shuffle=False, collate=collate)
    assert loader.next_batch().shape == (4, 3)
    with pytest.raises(SampleError, match="sample 6 cannot be collated: ValueError: unsupported image"):
        loader.next_batch()


@pytest.mark.parametrize("engine", [False, True])
def test_an_epoch_with_a_bad_sample_stops_there_and_after_the_fix_reads_every_sample_once(
    engine: bool,
) -> None:
    """A sample that cannot be collated stops the epoch at its batch, as often as it is asked
    for; once it is repaired the same epoch goes on from that batch and has read every sample
    exactly once: it never drops out."""
    data = samples(16)
    data[9] = {"x": np.zeros((5,), np.float32), "y": np.int32(9)}  # cannot be stacked with the rest
    source = data
    if engine:
        import mindspore.dataset as ds

        source = ds.GeneratorDataset(Rows(data), column_names=["x", "y"])
    loader = DataLoader(source, 4, seed=3)
    read: list[int] = []
    for _ in range(2):
        with pytest.raises(SampleError, match="sample 9") as info:
            for batch in loader:
                read += [int(v) for v in batch["y"]]
        assert info.value.index == 9 and loader.epoch == 0
    assert 9 in loader.next_indices() and 9 not in read
    data[9] = {"x": np.full((3,), 9, np.float32), "y": np.int32(9)}  # repaired
    read += epoch_ids(loader)
    assert sorted(read) == list(range(16))
    assert loader.epoch == 0 and loader.step == len(loader)


def test_a_sample_the_dataset_engine_skips_is_an_error_not_a_shift(monkeypatch) -> None:
    """Rows of a GeneratorDataset are checked against the indices asked for: an engine that
    skipped sample 5 would otherwise shift every later sample into the wrong batch."""
    import mindspore.dataset as ds

    loader = DataLoader(ds.GeneratorDataset(Rows(samples(8)), column_names=["x", "y"]), 4, shuffle=False)
    real = ds.GeneratorDataset

    def skipping(source, *args, sampler, **kwargs):
        return real(source, *args, sampler=[i for i in sampler if i != 5], **kwargs)

    monkeypatch.setattr(ds, "GeneratorDataset", skipping)
    with pytest.raises(SampleError, match="sample 5 was not delivered by the dataset engine") as info:
        loader.next_batch()
        loader.next_batch()
    assert info.value.index == 5


@pytest.mark.parametrize("engine", [False, True])
def test_a_sample_that_cannot_be_read_is_named(engine: bool) -> None:
    class Broken:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int):
            if i == 5:
                raise OSError("truncated file")
            return np.full((2,), i, np.float32), np.int32(i)

    source = Broken()
    if engine:
        import mindspore.dataset as ds

        source = ds.GeneratorDataset(source, column_names=["x", "y"])
    loader = DataLoader(source, 4, shuffle=False)
    # MindSpore's engine reads ahead of the batch asked for, so it may report sample 5 while the
    # first batch is still being read; a sequence source reports it with the second batch.
    with pytest.raises(SampleError, match=r"sample 5 cannot be read.*truncated file") as info:
        first = loader.next_batch()
        assert engine or [int(v) for v in first[1]] == [0, 1, 2, 3]
        loader.next_batch()
    assert info.value.index == 5


def test_owned_reading_reads_only_the_owned_micro_batches() -> None:
    config = PlanConfig(pp=3, micro=6, preprocess="frozen")  # rank 1 owns micro-batches 1 and 4
    assert config.owned(1) == (1, 4)
    source = Counting(48)
    owned = DataLoader(source, 12, seed=2, micro_batch_num=6, read_micros=config.owned(1))
    full = DataLoader(samples(48), 12, seed=2)
    for _ in range(4):  # across the epoch boundary (4 batches per epoch)
        source.read.clear()
        got, want = owned.next_batch(), full.next_batch()
        rows = [2, 3, 8, 9]  # micro-batches 1 and 4, two rows each
        assert sorted(source.read) == sorted(int(v) for v in want["y"][rows])
        np.testing.assert_array_equal(got["x"][rows], want["x"][rows])
        others = [r for r in range(12) if r not in rows]
        assert not got["x"][others].any() and got["x"].shape == want["x"].shape


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"batch_size": 40}, "fewer than one global batch"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank must be < dp_size=2"),
        ({"read_micros": (0,)}, "read_micros needs micro_batch_num"),
        ({"micro_batch_num": 3, "read_micros": (0,)}, "batch_size 4 is not divisible by micro_batch_num=3"),
        ({"micro_batch_num": 2, "read_micros": (2,)}, "at least one of the micro-batches 0..1"),
        ({"collate": "stack"}, "collate must be callable"),
    ],
)
def test_bad_options_name_the_value(options: dict, words: str) -> None:
    options = {"batch_size": 4, **options}
    with pytest.raises(DataError, match=words):
        DataLoader(samples(32), **options)


def test_a_source_that_is_not_a_sequence_is_refused() -> None:
    with pytest.raises(DataError, match="source must be a sequence of samples"):
        DataLoader(iter(samples(8)), 2)


class OwnedSchedule:
    """What the loader reads of a schedule for owned reading (its options)."""

    def __init__(self, input: str = "owned", tower_order: str = "balanced", micro: int = 2) -> None:
        self.input, self.tower_order, self.micro_batch_num = input, tower_order, micro


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"owned_by": OwnedSchedule(input="replicated")}, "owned_by needs a schedule with input='owned'"),
        (
            {"owned_by": OwnedSchedule(), "read_micros": (0,), "micro_batch_num": 2},
            "pass neither micro_batch_num",
        ),
        ({"owned_by": OwnedSchedule()}, "tower_order='balanced' and owned input needs sample_cost=fn"),
        ({"owned_by": OwnedSchedule(tower_order="arrival"), "sample_cost": len}, "sample_cost is used by"),
        ({"owned_by": OwnedSchedule(micro=3), "sample_cost": len}, "batch_size 4 is not divisible"),
        ({"sample_cost": len}, "it needs owned_by=schedule"),
    ],
)
def test_bad_owned_reading_options_name_the_value(options: dict, words: str) -> None:
    with pytest.raises(DataError, match=words):
        DataLoader(samples(32), 4, **options)
