"""PyTorch ``transformers`` loads a trained export and gives graph_exec's logits (float32, 1e-5).

For Llama, the tied Qwen2 and Qwen2-VL: a pretrained directory (``make_pretrained``), one Adam
step through the pipeline, ``export_pretrained``; then ``examples/torch_interop.py``: its
reference half (here) writes the batch and the logits of graph_exec's ``evaluate()`` and of
mindone's ``from_pretrained``, its compare half loads the export with PyTorch
``transformers``' ``from_pretrained`` and compares. PyTorch is not a dependency of graph_exec:
the compare half runs in this process when ``torch`` and ``transformers``' PyTorch models import
here, else under the interpreter named by ``GRAPH_EXEC_TORCH_PYTHON`` (an environment with
``torch``, ``transformers``, ``safetensors`` and ``numpy``). CI makes such an environment
(``.ci/torch_env``, called by ``.ci/run``), and under ``CI`` a missing one fails the test; elsewhere
it is skipped, with the command that runs it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import graph_exec as ge
import graph_exec.models as gm
from graph_exec.examples import llama, qwen2vl, torch_interop
from graph_exec.examples.make_pretrained import make_pretrained

SCRIPT = Path(torch_interop.__file__)
TORCH_PYTHON = os.environ.get("GRAPH_EXEC_TORCH_PYTHON")


def torch_here() -> bool:
    """Whether PyTorch and ``transformers``' PyTorch models import in this process."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        from transformers import LlamaForCausalLM  # noqa: F401  (the PyTorch class)
    except ImportError:
        return False
    return True


HOW = (
    "PyTorch transformers is not importable here and GRAPH_EXEC_TORCH_PYTHON is unset (graph_exec "
    "does not depend on torch); to run it: GRAPH_EXEC_TORCH_PYTHON=$(bash .ci/torch_env) pytest "
    "tests/runtime/test_torch_interop.py (a venv .venv-torch with torch 2.13.0+cpu and transformers "
    "4.57.1, as .ci/run makes; docs/testing.md)"
)


def torch_or_skip() -> None:
    """Skip without PyTorch, with the command that runs the test; fail instead under ``CI``, whose
    ``.ci/run`` sets ``GRAPH_EXEC_TORCH_PYTHON``: a skip there would hide a broken CI set-up."""
    if torch_here() or TORCH_PYTHON:
        return
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"CI must run the PyTorch interop test: {HOW}")
    pytest.skip(HOW)


def trained_export(name: str, folder: Path) -> Path:
    """``name``'s pretrained directory after one Adam step through a 2-stage pipeline, exported."""
    source = make_pretrained(name, folder / "in", seed=4, dtype="float32")  # logits compared in float32
    options = {"image_grid": qwen2vl.SIZES["tiny"].grid} if name == "qwen2vl" else {}
    parts = gm.load_split(source, 2, **options)
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(parts.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        2,
        parts.preprocess,
        parts.num_transpose_layers,
        mode="pynative",
        loss_fn=gm.causal_lm_loss,
        tied_parameters=parts.tied_weights,  # trained as one weight: an export refuses copies that differ
    )
    inputs, labels = qwen2vl.batch(parts.model, 1, 4) if name == "qwen2vl" else llama.batch(1, 4)
    sched.run(*inputs, labels=labels)
    sched.step(ms.nn.Adam(sched.trainable_params(), learning_rate=1e-2))
    return gm.export_pretrained(parts, folder / "out")  # float32, the directory's torch_dtype


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2vl"])
def test_torch_transformers_gives_graph_exec_logits(tmp_path, name):
    torch_or_skip()
    export = trained_export(name, tmp_path)
    batch = tmp_path / "batch.npz"
    stored = torch_interop.reference(export, batch)
    np.testing.assert_allclose(stored["logits_graph_exec"], stored["logits_mindone"], atol=1e-5, rtol=0)
    if torch_here():
        diffs = torch_interop.compare(export, batch)
        assert max(diffs.values()) <= torch_interop.ATOL, diffs
    else:
        done = subprocess.run(
            [TORCH_PYTHON, str(SCRIPT), "compare", str(export), str(batch)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        print(done.stdout)
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        assert ": OK" in done.stdout
