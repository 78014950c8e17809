"""One place that prepares MindSpore's execution settings for this library.

Which settings a target gets is decided in :mod:`graph_exec.device`; this module applies them.
"""

from __future__ import annotations

import logging
import os
import sys

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


def prepare_mindspore(
    device: str | None = None, *, device_id: int | None = None, verbose: bool = False
) -> str:
    """Select ``device`` (if given; ``device_id`` picks one of the host's devices, see
    :func:`local_device_id`) and apply the settings this library relies on.

    Logs are quiet (errors only, see :func:`quiet_logs`) unless ``verbose``. Where the device
    policy asks for synchronous dispatch (:attr:`~graph_exec.device.DevicePolicy.synchronous_dispatch`:
    CPU with its fast paths on), PyNative dispatch is made synchronous (``launch_blocking``) and
    MindSpore's host tasks run on the calling thread (:data:`HOST_BLOCKING_ENV` = 1, unless the
    user set it): on small CPU machines the asynchronous pipeline was measured 2.5-15x slower,
    and handing every taped call and bprop to MindSpore's pipeline threads made a 2-rank
    ``embed_lm`` step in graph mode 1.5x slower (71.9 against 46.3 ms, back to back). Elsewhere
    MindSpore's asynchronous dispatch is kept. Returns the device target in use. Idempotent.
    """
    global _prepared
    quiet_logs(verbose)
    import mindspore as ms

    from graph_exec.device import choose_again, policy

    if device is not None:
        ms.set_device(device, device_id)
    current = choose_again() if device is not None else policy()
    if current.synchronous_dispatch and _prepared != current.target:
        ms.runtime.launch_blocking()
        os.environ.setdefault(HOST_BLOCKING_ENV, "1")
    _prepared = current.target
    return current.target


def local_device_id(device: str, local_workers: int | None = None) -> int | None:
    """The device a rank launched by msrun selects on ``device``: its local rank (its rank modulo
    the workers of its host, ``local_workers``; default: msrun's ``DEVICE_ID``, which is the local
    rank), where the device policy gives each rank a device of its own; ``None`` on CPU and outside
    msrun."""
    from graph_exec.device import DevicePolicy

    if not DevicePolicy.for_target(device).device_per_rank:
        return None
    if local_workers is not None and "RANK_ID" in os.environ:
        return int(os.environ["RANK_ID"]) % local_workers
    return int(os.environ["DEVICE_ID"]) if "DEVICE_ID" in os.environ else None
