"""ZeRO-1's local refusals (graph_exec/runtime/optimizer_sharding.py, options.py): without
data-parallel replicas, and an optimizer whose state is not named per parameter. The 4-rank
numerics are tests/multirank/test_mesh.py::test_optimizer_sharding_matches_the_unsharded_run."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn

import graph_exec as ge
from graph_exec.runtime.optimizer_sharding import check_shardable
from tests.models.common import loss_fn
from tests.models.pipeline import build


def test_sharding_without_replicas_is_refused_at_construction_naming_dp() -> None:
    model = build(2, "none")
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(model.stages)]
    with pytest.raises(
        ValueError, match=r"optimizer_sharding=True .* the mesh has dp=1 .* --dp D with --zero 1"
    ):
        ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn, optimizer_sharding=True)
    with pytest.raises(ValueError, match=r"optimizer_sharding must be a bool \(True or False\), got 1"):
        ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn, optimizer_sharding=1)
    assert ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn).optimizer_params() == (
        ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn).trainable_params()
    )


class _GlobalNormAdam(nn.Adam):
    """An Adam that also keeps one tensor over every parameter: not shardable by parameter."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.norm_history = Parameter(ms.Tensor(np.zeros(4, np.float32)), name="norm_history")


@pytest.mark.parametrize(
    "make",
    [nn.Adam, nn.AdamWeightDecay, lambda p: nn.SGD(p, momentum=0.9), lambda p: nn.Momentum(p, 0.1, 0.9)],
)
def test_optimizers_with_per_parameter_state_are_shardable(make) -> None:
    params = nn.Dense(3, 2).trainable_params()
    check_shardable(make(params), params)


def test_a_global_state_tensor_is_refused_by_name() -> None:
    params = nn.Dense(3, 2).trainable_params()
    with pytest.raises(ValueError, match=r"cannot shard _GlobalNormAdam: its state 'norm_history'"):
        check_shardable(_GlobalNormAdam(params), params)
