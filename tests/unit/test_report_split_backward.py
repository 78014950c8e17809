"""Measured-timeline reports know the split backward's steps: I and W are body compute."""

from __future__ import annotations

from graph_exec.report.analysis import calls_hook
from graph_exec.report.trace import category


def test_i_and_w_are_compute_and_call_hooks_except_the_last_stages_i() -> None:
    assert [category(t) for t in ("I1.0", "W0.3", "Bsend1.0", "TBWD0")] == [
        "compute",
        "compute",
        "p2p",
        "preprocess",
    ]
    assert calls_hook("I0.0", last_stage=1) and calls_hook("W1.0", last_stage=1)
    assert not calls_hook("I1.0", last_stage=1)  # the fused F computed it; I only ships
