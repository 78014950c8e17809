"""Worker side of the start-up, compilation and shutdown progress of ``graph-exec run``/``bench``.

Between launching msrun and the first finished step a job spends most of its time in
communication set-up and graph compilation, and after the last step in writing records and
exiting: without a word, the user cannot tell a slow start from a hang. Workers print status
lines (prefix :data:`STATUS`, one JSON object each) at those moments and, while the first step
compiles, every few seconds; :class:`graph_exec.cli.status.StatusPrinter` turns them into words.
Lives below both the harness (which prints them) and the command line (which reads them).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

#: Prefix of a worker's status lines (the progress lines use ``report.job.PROGRESS``).
STATUS = "@@graph-exec-status "

#: Seconds between two compile-progress lines while the first step runs.
COMPILE_REPORT_S = 3.0


def announce(phase: str, **fields: object) -> None:
    """Worker side: print one status line (``phase``: started, compiling, finishing)."""
    print(STATUS + json.dumps({"phase": phase, **fields}), flush=True)


class CompileWatch:
    """Worker side: while running, announce the compilation count whenever it grew.

    ``count()`` returns ``(graphs, seconds)`` so far; it is read from this thread while the
    main thread compiles (plain integers and floats: a stale read is harmless).
    """

    def __init__(self, count: Callable[[], tuple[int, float]]) -> None:
        self._count = count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="compile-watch", daemon=True)
        self._began = time.monotonic()

    def __enter__(self) -> CompileWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        shown = 0
        while not self._stop.wait(COMPILE_REPORT_S):
            graphs, seconds = self._count()
            if graphs > shown:
                shown = graphs
                announce("compiling", graphs=graphs, seconds=seconds, elapsed=time.monotonic() - self._began)
