"""How the transport reaches MindSpore's send and receive ops (no communication: fake ops).

The real ops are exercised by every multi-rank test, on the world group and on mesh groups.
"""

from __future__ import annotations

import builtins

import pytest

from graph_exec.transport import p2p


class _Handle:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait(self) -> None:
        self.log.append("wait")


def _ops(log: list, with_handles: bool):
    def send_op(tensor, peer, group, tag):
        log.append(("send", tensor, peer, group, tag))
        return (tensor, _Handle(log)) if with_handles else tensor

    def recv_op(tensor, tag, peer, group):
        log.append(("recv", tensor, peer, group, tag))
        return (tensor, _Handle(log)) if with_handles else tensor

    return send_op, recv_op


def test_direct_ops_get_the_peers_group_rank_and_receives_are_waited() -> None:
    log: list = []
    ops = p2p.DirectPointToPoint(*_ops(log, with_handles=True), "dp", group_ranks=(5, 7))
    handle = ops.isend("t", 1)
    ops.recv("r", 0)
    assert log[0] == ("send", "t", 7, "dp", 0)
    assert log[1:] == [("recv", "r", 5, "dp", 0), "wait"]  # the receive waited, the send did not
    handle.wait()
    assert log[-1] == "wait"


def test_a_send_without_a_handle_gives_one_that_returns_at_once() -> None:
    log: list = []
    ops = p2p.DirectPointToPoint(*_ops(log, with_handles=False), "g", group_ranks=(0, 1))
    assert ops.isend("t", 1).wait() is None
    ops.recv("r", 0)
    assert log == [("send", "t", 1, "g", 0), ("recv", "r", 0, "g", 0)]


def test_public_functions_get_world_ranks() -> None:
    calls: list = []

    class Dist:
        def isend(self, tensor, dst, group):
            calls.append(("isend", tensor, dst, group))
            return "handle"

        def recv(self, tensor, src, group):
            calls.append(("recv", tensor, src, group))

    ops = p2p.PublicPointToPoint(Dist(), "pp", world_ranks=(2, 6))
    assert ops.isend("t", 1) == "handle"
    ops.recv("r", 0)
    assert calls == [("isend", "t", 6, "pp"), ("recv", "r", 2, "pp")]


def test_without_the_ops_the_public_functions_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_generated_ops(name, *args, **kwargs):
        if name == "mindspore.ops.auto_generate.gen_ops_prim":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_generated_ops)
    monkeypatch.setattr("mindspore.communication.get_group_rank_from_world_rank", lambda rank, group: rank)
    assert isinstance(p2p.point_to_point(object(), "g", (0, 1)), p2p.PublicPointToPoint)


def test_group_ranks_are_resolved_once_through_mindspore(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list = []

    def group_rank(rank, group):
        asked.append((rank, group))
        return rank - 4

    monkeypatch.setattr("mindspore.communication.get_group_rank_from_world_rank", group_rank)
    ops = p2p.point_to_point(object(), "dp", (4, 6))
    assert isinstance(ops, p2p.DirectPointToPoint)
    assert asked == [(4, "dp"), (6, "dp")]
    assert ops._group_ranks == (0, 2)


def test_without_communication_the_public_functions_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_initialised(rank, group):
        raise RuntimeError("Distributed Communication has not been inited.")

    monkeypatch.setattr("mindspore.communication.get_group_rank_from_world_rank", not_initialised)
    assert isinstance(p2p.point_to_point(object(), "g", (0, 1)), p2p.PublicPointToPoint)
