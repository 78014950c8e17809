"""One place that prepares MindSpore's execution settings for this library."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_prepared: str | None = None


def prepare_mindspore(device: str | None = None) -> str:
    """Select ``device`` (if given) and apply the settings this library relies on.

    On CPU, PyNative dispatch is made synchronous (``launch_blocking``): the default
    asynchronous pipeline was measured 2.5–15x slower on small CPU machines, for eager compute
    and for communication alike. Returns the device target in use. Idempotent.
    """
    global _prepared
    import mindspore as ms

    if device is not None:
        ms.set_device(device)
    target = str(ms.get_context("device_target"))
    if target == "CPU" and _prepared != target:
        ms.runtime.launch_blocking()
    _prepared = target
    return target


def wait_for(tensors: Iterable[Any]) -> None:
    """Block until every tensor (``None`` entries skipped) has been computed, in order.

    A compiled MindSpore call may return before its graph has run; ``asnumpy()`` is the wait
    that works on CPU (``mindspore.runtime.synchronize()`` does not wait on its first call).
    """
    for tensor in tensors:
        if tensor is not None:
            tensor.asnumpy()
