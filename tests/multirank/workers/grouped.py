"""Run several worker scripts one after another in one msrun launch (see docs/testing.md).

Each msrun launch pays seconds of start-up (processes, imports, communication init) and its own
compilations, so ``tests/multirank/launch_groups.py`` groups suites that need the same number of
ranks and the same environment into one launch of this driver. Each member runs as if it were
the launched script (``__main__``, its own ``sys.argv``), between ``MEMBER <member> BEGIN`` and
``MEMBER <member> END rc=<exit status>`` lines, so the conftest can hand every test the log
section of its own member. Communication is initialised once: until a member calls ``init()``
the process looks uninitialised to it (``GlobalComm.INITED`` is false), as in a launch of its
own, so a member's checks of what happens before ``init()`` still hold; the device is set once
(a second ``mindspore.set_device`` to the same device is skipped: MindSpore refuses it).

A member that exits non-zero ends the launch: its ranks' message order may be lost, so the
members after it are not run (their tests fail, naming the member that stopped the launch).

Usage: ``grouped.py SCRIPT[:ARG...] ...`` with every member's arguments joined by ``:``.
"""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path

WORKERS = Path(__file__).parent
#: The driver's last line, after every member exited with status 0.
ALL_MEMBERS_DONE = "ALL MEMBERS DONE"


def share_one_init() -> None:
    """Make ``mindspore.communication.init`` initialise once per process and only mark the
    process initialised on later calls (a second real ``init()`` would start another cluster)."""
    from mindspore import communication
    from mindspore.communication import GlobalComm, management

    real_init = management.init
    started = []

    def init(backend_name: str | None = None) -> None:
        if not started:
            real_init(backend_name)
            started.append(True)
        GlobalComm.INITED = True

    communication.init = management.init = init


def set_device_once() -> None:
    """Make ``mindspore.set_device`` a no-op when asked again for the device already set (every
    member's ``prepare_mindspore`` asks; MindSpore refuses to set the device twice)."""
    import mindspore as ms

    real_set_device = ms.set_device
    chosen: list[tuple] = []

    def set_device(device_target: str, device_id: int | None = None) -> None:
        if chosen and chosen[0] == (device_target, device_id):
            return
        real_set_device(device_target, device_id)
        chosen.append((device_target, device_id))

    ms.set_device = set_device


def run_member(member: str) -> int:
    """Run one member as ``__main__``; its exit status (an exception: printed, status 1)."""
    from mindspore.communication import GlobalComm

    script, *args = member.split(":")
    path = WORKERS / script
    GlobalComm.INITED = False  # until the member's own init(), as in a launch of its own
    sys.argv = [str(path), *args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        code = done.code
        if isinstance(code, str):  # the interpreter would print it on exit
            print(code, file=sys.stderr, flush=True)
        return code if isinstance(code, int) else int(code is not None)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def main(members: list[str]) -> int:
    share_one_init()
    set_device_once()
    for member in members:
        print(f"MEMBER {member} BEGIN", flush=True)
        status = run_member(member)
        print(f"MEMBER {member} END rc={status}", flush=True)
        if status != 0:
            return status
    print(ALL_MEMBERS_DONE, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
