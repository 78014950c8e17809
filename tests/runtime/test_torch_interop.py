"""PyTorch ``transformers`` loads a trained export and gives graph_exec's logits (float32, 1e-5).

For Llama, the tied Qwen2 and Qwen2-VL: a pretrained directory (``make_pretrained``), one Adam
step through the pipeline, ``export_pretrained``; then ``examples/torch_interop.py``: its
reference half (here) writes the batch and the logits of graph_exec's ``evaluate()`` and of
mindone's ``from_pretrained``, its compare half loads the export with PyTorch
``transformers``' ``from_pretrained`` and compares. PyTorch is not a dependency of graph_exec:
the compare half runs in this process when ``torch`` and ``transformers``' PyTorch models import
here, else under the interpreter named by ``GRAPH_EXEC_TORCH_PYTHON`` (an environment with
``torch``, ``transformers``, ``safetensors`` and ``numpy``); with neither, the test is skipped.
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


pytestmark = pytest.mark.skipif(
    not torch_here() and not TORCH_PYTHON,
    reason="PyTorch transformers is not importable here and GRAPH_EXEC_TORCH_PYTHON names no "
    "interpreter that has it (graph_exec does not depend on torch)",
)


def trained_export(name: str, folder: Path) -> Path:
    """``name``'s pretrained directory after one Adam step through a 2-stage pipeline, exported."""
    source = make_pretrained(name, folder / "in", seed=4, dtype="float32")  # logits compared in float32
    options = {"image_grid": qwen2vl.SIZES["tiny"].grid} if name == "qwen2vl" else {}
    parts = gm.load_split(source, 2, **options)
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(parts.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages, 2, parts.preprocess, parts.num_transpose_layers, mode="pynative", loss_fn=gm.causal_lm_loss
    )
    inputs, labels = qwen2vl.batch(parts.model, 1, 4) if name == "qwen2vl" else llama.batch(1, 4)
    sched.run(*inputs, labels=labels)
    sched.step(ms.nn.Adam(sched.trainable_params(), learning_rate=1e-2))
    return gm.export_pretrained(parts, folder / "out")  # float32, the directory's torch_dtype


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2vl"])
def test_torch_transformers_gives_graph_exec_logits(tmp_path, name):
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
