"""What the ranks of a schedule must agree on, as the named facts the handshake compares.

:func:`graph_exec.runtime.handshake.check_ranks_agree` hashes these per name, so a mismatch is
reported by its name (``loss_reduction``, ``preprocess frozen values``) on every rank. Within a
pipeline the ranks share the plan, the options every end of step depends on (its collectives
are mesh-wide) and the preprocess replica; across data-parallel replicas the same pipeline rank
also shares its stages' parameters and the data-parallel options. Every rank of a group builds
the same keys in the same order, whatever its values.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from graph_exec.runtime.handshake import describe_parameters, parameter_values_digest
from graph_exec.runtime.loss_scaling import describe_loss_scaler
from graph_exec.schedule import PlanConfig


def training_loop_facts(schedule: Any) -> dict[str, str]:
    """The options every rank's end of step must share (the collectives there are mesh-wide)."""
    bucketing = schedule.options.bucketing
    return {
        "loss_reduction": schedule.loss_reduction,
        "loss_scaler": describe_loss_scaler(schedule.loss_scaler),
        "tied_parameters": repr(schedule.tied_parameters),
        "shapes": schedule.shapes if bucketing is None else bucketing.describe(),
        "tower_order": schedule.tower_order,
    }


def pipeline_facts(schedule: Any, config: PlanConfig) -> dict[str, str]:
    """What must be identical on every rank of a pipeline (compared by ``check_ranks_agree``)."""
    common = {
        "loss_fn": "given" if schedule.loss_fn is not None else "none",
        "scale_grads": str(schedule.scale_grads),
        **training_loop_facts(schedule),
    }
    if not config.transpose:
        # Only rank 0 runs the preprocess (the others may pass None): compare the body.
        alone = "not compared: only rank 0 runs the preprocess"
        return {
            "plan": f"{replace(config, preprocess='none', num_preprocess_layers=0)}",
            **common,
            "preprocess trainable parameters": alone,
            "preprocess frozen parameters": alone,
            "preprocess frozen values": alone,
        }
    module = schedule.preprocess_module
    params = [] if module is None else list(module.get_parameters())
    frozen = [p for p in params if not p.requires_grad]
    return {
        "plan": f"{config}",
        **common,
        "preprocess trainable parameters": describe_parameters([p for p in params if p.requires_grad]),
        "preprocess frozen parameters": describe_parameters(frozen),
        "preprocess frozen values": parameter_values_digest(frozen),
    }


def replica_facts(schedule: Any, config: PlanConfig) -> dict[str, str]:
    """What the same pipeline rank of every replica must share (compared in its dp group)."""
    stage_params = [p for s in schedule.stages for p in s.submodule.get_parameters()]
    return {
        **pipeline_facts(schedule, config),
        "mesh": schedule.mesh.describe(),
        "stage parameters": describe_parameters(stage_params),
        "trainable parameters": describe_parameters(schedule.trainable_params()),
        "dp_bucket_bytes": str(schedule.dp_bucket_bytes),
        "optimizer_sharding": str(schedule.optimizer_sharding),  # the owners' broadcasts after step()
    }
