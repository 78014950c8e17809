"""What the data pipeline raises: always naming the sample (its index in the source)."""

from __future__ import annotations

from graph_exec.errors import GraphExecError


class DataError(GraphExecError, ValueError):
    """A bad loader option or position; the message names the value and what is allowed."""


class SampleError(DataError):
    """A sample could not be read or collated. ``index`` is its position in the source.

    Raised instead of skipping the sample: an epoch never silently loses one.
    """

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index
