"""One small all-reduce of host numbers over a group: what the owned-input data loader exchanges
(each micro-batch's size) so that every rank of a pipeline decides the same tower placement."""

from __future__ import annotations

import numpy as np

from graph_exec.transport.comm import Transport
from graph_exec.transport.group import CommGroup


class HostSum:
    """``HostSum(group, timeout_s)(values)``: the SUM of a small float32 array over ``group``,
    through the group's own :class:`Transport` (its deadline, the silent peers named on a time-out).
    Built once per user: the transport registers the group."""

    def __init__(self, group: CommGroup, timeout_s: float) -> None:
        self.transport = Transport(timeout_s=timeout_s, group=group)

    def __call__(self, values: np.ndarray) -> np.ndarray:
        import mindspore as ms

        tensor = ms.Tensor(np.ascontiguousarray(values, dtype=np.float32))
        self.transport.all_reduce_sum([tensor])
        return tensor.asnumpy().copy()  # through the tensor: on a device it is not in host memory
