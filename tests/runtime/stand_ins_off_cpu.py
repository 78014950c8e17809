"""A process that acts as a GPU/Ascend script: MindSpore's device target reads ``TARGET``
(``argv[2]``), chosen ``before`` or ``after`` (``argv[1]``) ``import graph_exec.models``.

MindSpore here can only run CPU kernels, so the target is faked where the library reads it
(:data:`graph_exec.device._read_target`, under ``current_target``). Every replaced op is then
called: an original op raises its missing-kernel error here (the error in its table entry), a
stand-in computes. Prints one JSON object: the policy's target, and for each replacement (and a
compiled function and layer) the first line of what it raised, or ``"computed"``. Run by
tests/runtime/test_cpu_ops.py in a fresh process, so nothing else installed the stand-ins first.
"""

from __future__ import annotations

import json
import sys

import mindspore as ms
import numpy as np
from mindspore import mint, ops

from graph_exec import device

ORDER, TARGET = sys.argv[1], sys.argv[2]


def choose(target: str) -> None:
    """What ``mindspore.set_device(target)`` does to the target the library reads."""
    device._read_target = lambda: target


def f32(*shape: int) -> ms.Tensor:
    return ms.Tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32))


X, Y = f32(3, 4), f32(4)
IDS = ms.Tensor(np.array([[0, 2, 2, 5]], np.int32))
COUNTS = ms.Tensor(np.array([2, 3], np.int32))
PAIR = ms.Tensor(np.array([4, 5], np.int32))

#: One call of each replaced attribute, looked up when called (after the stand-ins are in).
CALLS = {
    "mindspore.mint.arange": lambda: mint.arange(5),
    "mindspore.mint.full": lambda: mint.full((2, 3), 7.0),
    "mindspore.mint.zeros_like": lambda: mint.zeros_like(X),
    "mindspore.mint.ones_like": lambda: mint.ones_like(X),
    "mindspore.mint.full_like": lambda: mint.full_like(X, 2.5),
    "mindspore.mint.stack": lambda: mint.stack([X, X], dim=1),
    "mindspore.mint.cumsum": lambda: mint.cumsum(X, 1),
    "mindspore.mint.outer": lambda: mint.outer(Y, Y),
    "mindspore.mint.repeat_interleave": lambda: mint.repeat_interleave(PAIR, COUNTS, 0),
    "mindspore.mint.nn.functional.pad": lambda: mint.nn.functional.pad(PAIR, (1, 0), value=0),
    "mindspore.mint.nn.functional.gelu": lambda: mint.nn.functional.gelu(X),
    "mindspore.mint.nn.functional.dropout": lambda: mint.nn.functional.dropout(X, p=0.5, training=True),
    "mindspore.mint.nn.functional.log_softmax": lambda: mint.nn.functional.log_softmax(X, dim=-1),
    "mindspore.mint.nn.functional.embedding": lambda: mint.nn.functional.embedding(IDS, f32(6, 3)),
    "mindspore.ops.rms_norm": lambda: ops.rms_norm(X, Y),
    "mindspore.mint.nn.Embedding": lambda: mint.nn.Embedding(6, 3)(IDS),
    "mindspore.mint.nn.LayerNorm": lambda: mint.nn.LayerNorm(4)(X),
    "mindspore.mint.nn.Conv3d": lambda: mint.nn.Conv3d(3, 4, 2, 2)(f32(1, 3, 2, 2, 2)),
}


def running_sum(x: ms.Tensor) -> ms.Tensor:
    """A compiled use (not ``mint.arange``: of constants, a graph folds it at compile time)."""
    return mint.cumsum(x, 1)


def outcome(call) -> str:
    try:
        out = call()
        (out[0] if isinstance(out, tuple) else out).asnumpy()
    except Exception as error:  # what it raised is the result
        lines = [line for line in str(error).splitlines() if line.strip(" -")]
        return f"{type(error).__name__}: {lines[0] if lines else ''}"
    return "computed"


def resolve(where: str):
    """The object at dotted path ``where`` (``mindspore.mint.nn.LayerNorm``) now."""
    owner, name = where.rsplit(".", 1)
    return getattr(sys.modules[owner], name)


def main() -> None:
    ms.runtime.launch_blocking()  # each op's error raised by its own call
    before = {where: resolve(where) for where in CALLS}
    if ORDER == "before":
        choose(TARGET)
    import graph_exec.models as gm

    if ORDER == "after":
        choose(TARGET)
    results = {where: outcome(call) for where, call in CALLS.items()}
    results["jit(function)"] = outcome(lambda: ms.jit(running_sum)(X))
    results["jit(mint.nn.LayerNorm)"] = outcome(lambda: ms.jit(mint.nn.LayerNorm(4))(X))
    print(
        json.dumps(
            {
                "policy": device.policy().target,
                "originals kept": {
                    r.where: gm.cpu_ops.original(r) is before[r.where] for r in gm.cpu_ops.REPLACEMENTS
                },
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
