"""Single-process runtime tests: quiet logs and the CPU settings, before MindSpore loads."""

import os

os.environ.setdefault("GLOG_v", "3")

from graph_exec.msenv import prepare_mindspore

prepare_mindspore("CPU")
