"""README's code runs as shown (and docs/models.md's vision-language block): the Usage blocks and the real-models block, each saved as a file,
train in one process.

``tests/unit/test_readme_usage.py`` keeps the blocks equal to ``examples/train_custom.py``; this
test runs what a reader copies, imports included, so a missing import or an undefined name in the
README fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.unit.test_readme_usage import usage_blocks

ROOT = Path(__file__).resolve().parents[2]


def _run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh process of its own (one process: no msrun variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MS_")}
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "GLOG_v": "3"},
        cwd=script.parent,
    )


def test_the_usage_blocks_run_as_one_script(tmp_path: Path) -> None:
    imports, core = usage_blocks()
    script = tmp_path / "usage.py"
    script.write_text(f"{imports}\n{core}\n", encoding="utf-8")
    done = _run(script, "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1", "2"], done.stdout
    assert all(float(line.split()[3]) > 0 for line in lines)


def _python_block_of(section: str, page: str = "README.md") -> str:
    """The first Python block under the heading ``section`` (any level) of ``page``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    start = re.search(rf"\n#+ {re.escape(section)}[^\n]*\n", text).end()
    following = re.compile(r"\n#{2,3} ").search(text, start)
    body = text[start : following.start() if following else None]
    return body.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_the_real_models_block_trains_a_tied_qwen2(tmp_path: Path) -> None:
    """The "Real models" block, as shown: a ``tie_word_embeddings=True`` Qwen2 through MPipe,
    ``tied_parameters=split.tied_weights`` included (one bare pair)."""
    script = tmp_path / "models.py"
    script.write_text(_python_block_of("Real models"), encoding="utf-8")
    done = _run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = [line for line in done.stdout.splitlines() if line.startswith("loss ")]
    assert len(loss) == 1 and float(loss[0].split()[1]) > 0, done.stdout


def test_the_vision_language_block_trains_on_mixed_images(tmp_path: Path) -> None:
    """docs/models.md's "Vision-language batches" block, as shown: real-size images (0, 1 and 2 per sample,
    each its own grid) and text of four lengths, through ``vlm_batch`` and MPipe."""
    script = tmp_path / "vlm.py"
    script.write_text(_python_block_of("Vision-language batches", "docs/models.md"), encoding="utf-8")
    done = _run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = [line for line in done.stdout.splitlines() if line.startswith("loss ")]
    assert len(loss) == 1 and np.isfinite(float(loss[0].split()[1])), done.stdout
