"""The tensors one rank owns, written to and read back from its MindSpore ``.ckpt`` file.

A rank owns every parameter of its stage chunks and of its preprocess replica (frozen ones
included, so a resumed job needs no other file), its loss scaler's state (the scale and, for a
``DynamicLossScaler``, the count of finite steps since the last change, stored under
:data:`SCALER_PREFIX`: a resumed fp16 job goes on with the scale it had reached, not the
initial one), the state of its MindSpore random generator (:data:`RNG_STATE`, what
``mindspore.get_rng_state()`` returns: seed and offset of ``mindspore.default_generator``) and,
when given, its optimizer's state: the optimizer's parameters that are not model parameters
(Adam's moments, step counters, the learning rate). Values are loaded *in
place* (:func:`~graph_exec.device.assign_in_place`): a compiled graph keeps reading a
parameter's storage, so swapping it (``set_data``) would force every graph to recompile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graph_exec.checkpoint.errors import CheckpointError
from graph_exec.device import assign_in_place


def _add(found: dict[str, Any], param: Any, what: str) -> None:
    seen = found.get(param.name)
    if seen is not None and seen is not param:
        raise CheckpointError(
            f"two different parameters are both named {param.name!r} ({what}): a checkpoint stores "
            "tensors by name, so names must be unique on a rank"
        )
    found[param.name] = param


#: Prefix of the loss scaler's tensors in a rank file (its own names, ``scale_value`` and
#: ``counter``, could be a model's).
SCALER_PREFIX = "graph_exec.loss_scaler."


#: Name of the random generator's state in a rank file.
RNG_STATE = "graph_exec.rng.default_generator"


def rng_state() -> dict[str, Any]:
    """This process's MindSpore generator state, by its name in a rank file.

    MindSpore 2.10's generator feeds the random operators that take a seed and an offset
    (``mint.nn.functional.dropout``, ``mint.rand``, ...: Ascend kernels) and, on CPU in
    pynative, graph_exec's dropout stand-in (``cpu_ops.dropout``). The older stateful operators
    (``nn.Dropout``, i.e. ``ops.Dropout``, ``ops.randn``, compiled random kernels) keep their
    generator inside each kernel, which MindSpore does not expose: those cannot be saved
    (docs/restarts.md, "Resuming exactly").
    """
    import mindspore as ms

    return {RNG_STATE: ms.get_rng_state()}


def restore_rng_state(stored: Mapping[str, Any]) -> None:
    """Set the generator to the state in ``stored``, if the file holds one (older ones do not)."""
    import mindspore as ms

    if RNG_STATE in stored:
        ms.set_rng_state(stored[RNG_STATE])


def model_parameters(schedule: Any) -> dict[str, Any]:
    """Every parameter of this rank's stage chunks and preprocess replica, and its loss
    scaler's state, by name."""
    cells = [stage.submodule for stage in schedule.stages]
    if getattr(schedule, "preprocess_module", None) is not None:
        cells.append(schedule.preprocess_module)
    found: dict[str, Any] = {}
    for cell in cells:
        for param in cell.get_parameters():
            _add(found, param, "in the model")
    scaler = getattr(schedule, "loss_scaler", None)
    for attribute in ("scale_value", "counter"):
        value = getattr(scaler, attribute, None)
        if value is not None:
            found[SCALER_PREFIX + attribute] = value
    return found


def optimizer_state(optimizer: Any, model: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer's own parameters (those that are not model parameters), by name."""
    from mindspore import nn

    if not isinstance(optimizer, nn.Cell):
        raise TypeError(
            f"optimizer must be a mindspore.nn.Cell (an nn.Optimizer), got {type(optimizer).__name__}"
        )
    model_ids = {id(p) for p in model.values()}
    found: dict[str, Any] = {}
    for param in optimizer.get_parameters():
        if id(param) in model_ids:
            continue
        if param.name in model:
            raise CheckpointError(
                f"optimizer state {param.name!r} has the name of a model parameter: a checkpoint "
                "stores tensors by name, so names must be unique on a rank"
            )
        _add(found, param, "in the optimizer")
    return found


def write(tensors: Mapping[str, Any], path: str) -> None:
    """Write ``tensors`` to ``path`` in MindSpore's own checkpoint format."""
    import mindspore as ms

    ms.save_checkpoint([{"name": name, "data": value} for name, value in tensors.items()], path)


def read(path: str, names: set[str] | None = None) -> tuple[dict[str, Any], int]:
    """The tensors of a MindSpore checkpoint file (``names``: only those, and only their bytes
    are read: :mod:`graph_exec.checkpoint.selective`), by name, and the bytes read from it."""
    import os

    import mindspore as ms

    from graph_exec.checkpoint import selective

    if names is None:
        return dict(ms.load_checkpoint(path)), os.path.getsize(path)
    return selective.read(path, names)


def mismatches(expected: Mapping[str, Any], stored: Mapping[str, Any], what: str) -> list[str]:
    """How ``stored`` (read from a file) fails to fit ``expected`` (live parameters), per name."""
    problems = []
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    if missing:
        problems.append(f"{what} missing from the file: {_names(missing)}")
    if extra:
        problems.append(f"{what} in the file that this rank does not have: {_names(extra)}")
    for name in sorted(set(expected) & set(stored)):
        have, got = expected[name], stored[name]
        if tuple(have.shape) != tuple(got.shape) or have.dtype != got.dtype:
            problems.append(
                f"{name}: file has {tuple(got.shape)} {got.dtype}, this rank has {tuple(have.shape)} {have.dtype}"
            )
    return problems


def assign(targets: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
    """Copy every stored value into its live parameter, in place."""
    for name, param in targets.items():
        assign_in_place(param, stored[name])


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
