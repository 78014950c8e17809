"""Runnable example models (installed as ``graph_exec.examples``).

``EXAMPLES`` maps each name that ``graph-exec run`` accepts to its module; import it to build.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the models import MindSpore: `graph-exec run --help` must not wait for it
    from graph_exec.examples.common import Example

EXAMPLES = {
    "vl_tower": "graph_exec.examples.vl_tower",
    "embed_lm": "graph_exec.examples.embed_lm",
    # MindSpore ONE models (pip install -e '.[models]')
    "qwen2vl": "graph_exec.examples.qwen2vl",
    "llama": "graph_exec.examples.llama",
}

#: Each example's ``Example.trainable_by_default``, known without importing it (and MindSpore),
#: so that ``graph-exec run``/``bench`` check their arguments at once; a test keeps them equal.
TRAINABLE_BY_DEFAULT = {"vl_tower": False, "embed_lm": True, "qwen2vl": False, "llama": True}


def load(name: str) -> Example:
    """The example called ``name``; unknown names raise ``ValueError`` listing the known ones."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; choose one of: {', '.join(EXAMPLES)}")
    return importlib.import_module(EXAMPLES[name]).EXAMPLE
