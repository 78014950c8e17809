"""Transport on two real ranks: tensor groups, collectives, abort notices and time-outs.

With ``GRAPH_EXEC_CPU_FAST_PATHS=0`` in the environment these run the device path: frames are
MindSpore tensors (no zero-copy into host memory) and every call goes through the communication
thread.
"""

import pytest

from graph_exec.device import fast_paths_requested
from tests.multirank.conftest import checks


def test_transport_exchanges_and_abort(run_workers):
    result = run_workers("transport_checks.py", 2, "basic", "60", timeout_s=120)
    assert {"roundtrip", "broadcast_param", "all_reduce_param", "remote_error"} <= checks(result, 0), (
        result.describe()
    )
    expected = {"none_kept", "values", "dtypes", "scalar", "label_mismatch", "abort_sent"}
    if fast_paths_requested():
        expected.add("zero_copy")
    assert expected <= checks(result, 1), result.describe()


@pytest.mark.parametrize(
    "backend_limit, waits",
    [
        (None, "waits_on_the_callers_thread"),  # the back end ends the wait at the time-out
        ("20", "waits_on_the_comm_thread"),  # the user's longer limit: the thread keeps the deadline
    ],
)
def test_silent_peer_times_out(run_workers, backend_limit, waits):
    env = None if backend_limit is None else {"MS_CPU_COMM_OP_TIMEOUT": backend_limit}
    result = run_workers("transport_checks.py", 2, "stuck", "3", timeout_s=90, env=env)
    if not fast_paths_requested():
        waits = "waits_on_the_comm_thread"  # the device path never relies on the back end's limit
    assert {"timeout", waits} <= checks(result, 0), result.describe()
    assert "stayed_silent" in checks(result, 1), result.describe()


def test_a_peer_silent_past_the_backends_default_limit_is_waited_for(run_workers):
    """MindSpore's CPU back end fails a receive after 30 s unless told otherwise; with a 60 s
    time-out a message sent after 38 s must still arrive."""
    result = run_workers("transport_checks.py", 2, "slow", "60", timeout_s=150)
    assert "waited_past_30s" in checks(result, 0), result.describe()
    assert "sent_late" in checks(result, 1), result.describe()
