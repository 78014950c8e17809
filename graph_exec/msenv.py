"""One place that prepares MindSpore's execution settings for this library."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

_prepared: str | None = None

#: MindSpore's switch that runs its host-side runtime tasks on the calling thread instead of
#: handing each to its pipeline threads and waiting for them. It is a developer variable found
#: in MindSpore 2.10's libraries, not in its documentation; MindSpore reads it when it runs,
#: so setting it after ``import mindspore`` works (measured).
HOST_BLOCKING_ENV = "MS_DEV_HOST_BLOCKING_RUN"


def quiet_logs(verbose: bool = False) -> None:
    """Keep MindSpore's log to errors unless ``verbose``.

    A training run otherwise prints dozens of ``[WARNING]`` lines that need no action
    (communication group set-up, deprecation notes of optimizers MindSpore itself creates).
    A level the user chose in ``GLOG_v`` is kept. Otherwise ``GLOG_v=3`` is set, which reaches
    child processes too, and MindSpore's Python logger is lowered to errors. MindSpore's C++
    side reads ``GLOG_v`` only when ``mindspore`` is first imported: a script that imports it
    before calling this keeps the C++ warnings of its own process (launch it with ``GLOG_v=3``,
    as ``graph-exec run`` and :func:`graph_exec.launch.launch` do). Errors always show.
    """
    if verbose or "GLOG_v" in os.environ:
        return  # asked for, or the user chose a level
    os.environ["GLOG_v"] = "3"  # noqa: SIM112 (glog spells it this way)
    if "mindspore" in sys.modules:  # too late for the C++ side of this process; Python's obeys
        from mindspore import log

        log._get_logger().setLevel(logging.ERROR)


def prepare_mindspore(device: str | None = None, *, verbose: bool = False) -> str:
    """Select ``device`` (if given) and apply the settings this library relies on.

    Logs are quiet (errors only, see :func:`quiet_logs`) unless ``verbose``. On CPU, PyNative
    dispatch is made synchronous (``launch_blocking``): the default asynchronous pipeline was
    measured 2.5–15x slower on small CPU machines, for eager compute and for communication
    alike. Also on CPU, MindSpore's host tasks run on the calling thread
    (:data:`HOST_BLOCKING_ENV` = 1, unless the user set it): otherwise every taped call and
    bprop hands work to MindSpore's pipeline threads and the caller spins until they are done,
    which on a 2-core machine made a 2-rank ``embed_lm`` step in graph mode 1.5x slower
    (71.9 against 46.3 ms, back to back) and gave the old compiled backward its slow mode.
    Returns the device target in use. Idempotent.
    """
    global _prepared
    quiet_logs(verbose)
    import mindspore as ms

    if device is not None:
        ms.set_device(device)
    target = str(ms.get_context("device_target"))
    if target == "CPU" and _prepared != target:
        ms.runtime.launch_blocking()
        os.environ.setdefault(HOST_BLOCKING_ENV, "1")
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
