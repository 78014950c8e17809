"""Parent side of the start-up, compilation and shutdown progress of ``graph-exec run``/``bench``:
the status lines of :mod:`graph_exec.report.status` in plain words."""

from __future__ import annotations

import time
from collections.abc import Callable


class StatusPrinter:
    """Parent side: status lines in words, with the time since the launch."""

    def __init__(self, ranks: int, write: Callable[[str], None]) -> None:
        self._began = time.monotonic()
        self._write = write
        self._write(f"starting {ranks} ranks with msrun (communication set-up, then compilation)...")

    def __call__(self, status: dict) -> None:
        elapsed = time.monotonic() - self._began
        phase = status.get("phase")
        if phase == "started":
            self._write(f"ranks connected after {elapsed:.1f} s; building the model and compiling...")
        elif phase == "compiling":
            graphs = status["graphs"]
            self._write(
                f"compiling... {graphs} graph{'s' if graphs != 1 else ''}, "
                f"{status['seconds']:.1f} s so far (last rank)"
            )
        elif phase == "finishing":
            self._write("training done; ranks are writing their records and exiting...")
