"""Noticing that a parameter's storage was replaced, which a compiled graph does not see.

A compiled graph holds on to the storage its parameters had when it was compiled: writes in
place (``ops.assign``, an optimizer, a broadcast into the parameter) are seen, but
``Parameter.set_data`` (``mindspore.load_param_into_net``, for one) swaps the storage and the old
graph keeps reading the old values (measured with MindSpore 2.10 on CPU). The graph executor
therefore takes a *token* of the parameters a kernel reads before each call and drops its
compiled kernels when the token changed. How the token is taken is the device policy's
:attr:`~graph_exec.device.DevicePolicy.storage_by_address`:

- by address (CPU fast path): the parameters' ``data_ptr()``, well under a microsecond each there;
- by ``set_data`` calls (every device): ``data_ptr()`` waits for the ops that write a tensor, which
  would serialise asynchronous dispatch, so each watched parameter's ``set_data`` is wrapped once
  (an attribute of that parameter object, so MindSpore's own callers go through it) to count its
  calls, and the token is the counts. A copy of the parameter (``copy.deepcopy`` makes a new
  ``Parameter``) is a different object and is not wrapped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Token = tuple[int, ...]


class _CountedSetData:
    """A parameter's ``set_data`` that counts its calls."""

    __slots__ = ("calls", "original")

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        self.calls += 1
        return result


def _counter(param: Any) -> _CountedSetData:
    """The call counter of ``param.set_data``, installed on first use."""
    counter = vars(param).get("set_data")
    if not isinstance(counter, _CountedSetData):
        counter = _CountedSetData(param.set_data)
        param.set_data = counter
    return counter


def storage_token(by_address: bool) -> Callable[[Sequence[Any]], Token]:
    """The function that takes the token of a parameter list, the way ``by_address`` says."""
    if by_address:
        return lambda params: tuple(param.data_ptr() for param in params)

    def set_data_calls(params: Sequence[Any]) -> Token:
        return tuple(_counter(param).calls for param in params)

    return set_data_calls
