"""What every test model shares: the loss, parameter naming and the comparison tolerance."""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

#: Tolerance of every comparison with a non-pipelined reference (and between the two modes).
ATOL = 1e-5
RTOL = 1e-4


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of class logits against int32 labels."""
    return ops.cross_entropy(logits, labels, reduction="mean")


def named(cell: nn.Cell, prefix: str) -> nn.Cell:
    """``cell`` with ``prefix`` in front of its parameter names (unique names per test)."""
    cell.update_parameters_name(prefix)
    return cell


def assert_close(actual: Tensor | np.ndarray, expected: Tensor | np.ndarray, what: str) -> None:
    """Element-wise ``|a - e| <= ATOL + RTOL * |e|``."""
    actual = actual.asnumpy() if isinstance(actual, Tensor) else actual
    expected = expected.asnumpy() if isinstance(expected, Tensor) else expected
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=RTOL, err_msg=what)


def assert_matches(sched, losses, ref_losses, ref_grads) -> None:
    """A step's losses and every gradient of ``sched`` equal the reference's, by name."""
    np.testing.assert_allclose([float(loss.asnumpy()) for loss in losses], ref_losses, atol=ATOL, rtol=RTOL)
    grads = sched.grads()
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad.asnumpy(), ref_grads[name], atol=ATOL, rtol=RTOL, err_msg=name)


def announce_policy() -> None:
    """Print this process's device policy (``POLICY <description>``), so that a multi-rank test
    can check that its workers took the path it asked for (see ``run_launch(device_path=...)``)."""
    from graph_exec.device import policy

    print(f"POLICY {policy().describe()}", flush=True)
