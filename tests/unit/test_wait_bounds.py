"""Each step's bound on waits for a peer (:mod:`graph_exec.runtime.wait_bounds`): the compile
window for a step that may compile, ``timeout_s`` for a steady one."""

from __future__ import annotations

import numpy as np
import pytest

import graph_exec as ge
from graph_exec.runtime import wait_bounds
from graph_exec.runtime.microbatch import split_batch
from graph_exec.runtime.options import options_from_keywords
from graph_exec.runtime.wait_bounds import DEFAULT_COMPILE_TIMEOUT_S, WaitBounds, compile_timeout


class Recording:
    """A transport that records the bounds it was given."""

    def __init__(self) -> None:
        self.bounds: list[float] = []

    def set_wait_bound(self, seconds: float) -> None:
        self.bounds.append(seconds)


def _batch(rows: int, cols: int = 3, dtype=np.float32):
    x = np.zeros((rows, cols), dtype)
    return split_batch((x,), {}, np.zeros((rows,), np.int32), 2)


def test_a_step_that_may_compile_gets_the_compile_window_and_a_steady_one_timeout_s() -> None:
    pipeline, replicas = Recording(), Recording()
    waits = WaitBounds(10.0, 600.0, (pipeline, None, replicas))
    steps = [
        ("run", _batch(4)),  # the first step: compiles
        ("run", _batch(4)),  # steady
        ("evaluate", _batch(4)),  # the forward-only kernels compile
        ("evaluate", _batch(4)),
        ("run", _batch(6)),  # a new shape
        ("run", _batch(6, dtype=np.float16)),  # a new dtype
        ("run", _batch(4)),  # seen before
    ]
    got = [waits.before_step(kind, batch) for kind, batch in steps]
    assert got == [600.0, 10.0, 600.0, 10.0, 600.0, 600.0, 10.0]
    assert pipeline.bounds == replicas.bounds == got


def test_the_signatures_kept_are_bounded_and_a_forgotten_one_only_waits_longer(monkeypatch) -> None:
    monkeypatch.setattr(wait_bounds, "KEPT_SIGNATURES", 2)
    waits = WaitBounds(1.0, 5.0, ())
    assert [waits.before_step("run", _batch(2 * n)) for n in (1, 2, 1, 3, 2)] == [5.0, 5.0, 1.0, 5.0, 5.0]
    assert len(waits._seen) == 2


@pytest.mark.parametrize("target", ["CPU", "Ascend"])
def test_the_default_window_is_timeout_s_only_where_one_back_end_limit_holds_for_every_wait(
    target, monkeypatch
) -> None:
    from graph_exec.device import DevicePolicy
    from graph_exec.transport import cpu_workarounds

    monkeypatch.setattr(cpu_workarounds, "policy", lambda: DevicePolicy.for_target(target))
    assert compile_timeout(None, 30.0) == (30.0 if target == "CPU" else DEFAULT_COMPILE_TIMEOUT_S)
    assert compile_timeout(45.0, 30.0) == 45.0


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (5.0, r"compile_timeout_s=5 is shorter than timeout_s=10"),
        (-1.0, "compile_timeout_s"),
        ("1", "compile"),
    ],
)
def test_a_bad_compile_timeout_is_refused_naming_it(value, words) -> None:
    with pytest.raises((ValueError, TypeError), match=words):
        options_from_keywords({"timeout_s": 10.0, "compile_timeout_s": value}, "ScheduleMPipeTranspose", True)


def test_the_option_reads_back() -> None:
    options = options_from_keywords({"compile_timeout_s": 900}, "ScheduleMPipeTranspose", True)
    assert options.compile_timeout_s == 900.0
    assert "compile_timeout_s" in (ge.ScheduleMPipeTranspose.__doc__ or "")
