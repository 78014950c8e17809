"""A worker that misbehaves on purpose, to prove the harness fails its test.

Rank 0 prints a FAIL line and exits 0; rank 1 passes its check, then exits with code 3.
"""

import sys
import time

from mindspore.communication import get_rank, init

from graph_exec.msenv import prepare_mindspore
from tests.models.common import announce_policy

prepare_mindspore("CPU")

announce_policy()
init()
if get_rank() == 0:
    print("CHECK probe FAIL deliberately", flush=True)
else:
    print("CHECK probe OK", flush=True)
    time.sleep(2)  # let rank 0 print before msrun sees this exit and stops the job
    sys.exit(3)
