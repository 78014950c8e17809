"""The host send frames' bound: staging frames are kept per exact layout once their send has
completed, at most ``cache_bytes`` of them, the least recently used dropped first; a layout seen
again after its frame was dropped gets a fresh frame that carries the right bytes."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from graph_exec.msenv import prepare_mindspore
from graph_exec.transport.frame_memory import HostFrames, TensorFrames, message_bytes
from graph_exec.transport.frames import layout_of
from graph_exec.transport.meta import TensorMeta, pack_label

LENGTHS = (300, 400, 500)  # float32: every message above the control message's 1024 bytes


@pytest.fixture(scope="module", autouse=True)
def _cpu() -> None:
    prepare_mindspore("CPU")


def _send(frames: HostFrames, n: int, seq: int):
    layout = layout_of((TensorMeta("float32", (n,)),))
    values = np.arange(n, dtype=np.float32) + seq
    _, staging = frames.compose(
        layout, "Fsend0.0", pack_label("Fsend0.0").tolist(), seq, (ms.Tensor(values),)
    )
    return layout, staging, values


def test_idle_send_frames_past_the_bound_go_oldest_first() -> None:
    sizes = [message_bytes(layout_of((TensorMeta("float32", (n,)),))) for n in LENGTHS]
    frames = HostFrames(0, cache_bytes=sizes[1] + sizes[2])
    staged = [_send(frames, n, seq)[1] for seq, n in enumerate(LENGTHS)]
    assert frames.cache_stats()["entries"] == 0  # all three sends in flight: none is idle
    for staging in staged:
        frames.reuse(staging)
    assert frames.cache_stats() == {
        "entries": 2,
        "bytes": sizes[1] + sizes[2],
        "max_bytes": sizes[1] + sizes[2],
        "evictions": 1,
        "evicted_bytes": sizes[0],
    }
    _, again, _ = _send(frames, LENGTHS[1], 7)
    assert again is staged[1]  # kept: reused
    layout, fresh, values = _send(frames, LENGTHS[0], 8)
    assert fresh is not staged[0]  # dropped: made anew, and carries this send's bytes
    assert np.array_equal(layout.views(fresh.frame)[0], values)


def test_the_device_path_stages_nothing() -> None:
    frames = TensorFrames(0, cache_bytes=0)
    assert frames.cache_stats()["entries"] == 0 and frames.cache_stats()["evictions"] == 0
    with pytest.raises(ValueError, match="buffer_cache_bytes must be an int >= 0, got -1"):
        TensorFrames(0, cache_bytes=-1)
