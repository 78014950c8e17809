"""Transport on two real ranks: tensor groups, collectives, abort notices and time-outs."""

from tests.multirank.conftest import checks


def test_transport_exchanges_and_abort(run_workers):
    result = run_workers("transport_checks.py", 2, "basic", "60", timeout_s=120)
    assert {"roundtrip", "broadcast_param", "all_reduce_param", "remote_error"} <= checks(result, 0), (
        result.describe()
    )
    assert {"none_kept", "values", "dtypes", "scalar", "zero_copy", "label_mismatch", "abort_sent"} <= checks(
        result, 1
    ), result.describe()


def test_silent_peer_times_out(run_workers):
    result = run_workers("transport_checks.py", 2, "stuck", "3", timeout_s=90)
    assert "timeout" in checks(result, 0), result.describe()
    assert "stayed_silent" in checks(result, 1), result.describe()
