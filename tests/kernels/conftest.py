"""Test setup for the kernel and executor tests: quiet logs, CPU settings, fresh models.

The models and helpers live with every other test model in :mod:`tests.models` (``kernel`` and
``common``).
"""

from __future__ import annotations

import os

# Before MindSpore is imported: it reads GLOG_v once, at import.
os.environ.setdefault("GLOG_v", "3")

import mindspore as ms
import pytest
from mindspore import nn

from graph_exec.msenv import prepare_mindspore
from tests.models.common import named
from tests.models.kernel import Classifier, Combiner, Mixer, Projector

prepare_mindspore("CPU")


@pytest.fixture
def pipeline() -> tuple[nn.Cell, dict[int, nn.Cell]]:
    """A preprocess and three stages, fresh (and seeded) for each test."""
    ms.set_seed(7)
    preprocess = named(Projector(), "pre.")
    stages = {0: named(Mixer(), "s0."), 1: named(Combiner(), "s1."), 2: named(Classifier(), "s2.")}
    return preprocess, stages
