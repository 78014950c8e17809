"""Test setup for the kernel and executor tests: quiet logs, CPU settings, fresh models.

Shared models and helpers live in ``kernel_models.py`` (a distinct module name: this folder is
not a package, so its modules are imported by bare name).
"""

from __future__ import annotations

import os

# Before MindSpore is imported: it reads GLOG_v once, at import.
os.environ.setdefault("GLOG_v", "3")

import mindspore as ms
import pytest
from kernel_models import Classifier, Combiner, Mixer, Projector, named
from mindspore import nn

from graph_exec.msenv import prepare_mindspore

prepare_mindspore("CPU")


@pytest.fixture
def pipeline() -> tuple[nn.Cell, dict[int, nn.Cell]]:
    """A preprocess and three stages, fresh (and seeded) for each test."""
    ms.set_seed(7)
    preprocess = named(Projector(), "pre.")
    stages = {0: named(Mixer(), "s0."), 1: named(Combiner(), "s1."), 2: named(Classifier(), "s2.")}
    return preprocess, stages
