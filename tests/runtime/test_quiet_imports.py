"""Importing the models package and mindone through it prints none of transformers' and mindone's
import-time noise, and leaves the user's own logging and warnings as they were."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import logging, warnings
import graph_exec.models as gm
from graph_exec.examples.make_pretrained import config_of
config_of("qwen2vl")
gm.mindone()
print("mine: printed")
logging.getLogger("transformers").warning("mine: logged")
warnings.warn("mine: warned", FutureWarning)
"""

NOISE = (
    "None of PyTorch, TensorFlow",
    "image_processor_class argument is deprecated",
    "Config not found for",
)


def test_importing_the_models_is_quiet_and_the_users_output_is_kept():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    both = done.stdout + done.stderr
    assert not [line for line in both.splitlines() if any(n in line for n in NOISE)], both
    assert "mine: printed" in done.stdout
    assert "mine: logged" in done.stderr and "mine: warned" in done.stderr
