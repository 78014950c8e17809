"""Runnable example models (installed as ``graph_exec.examples``).

``EXAMPLES`` maps each name that ``graph-exec run`` accepts to its module; import it to build.
"""

from __future__ import annotations

import importlib

from graph_exec.examples.common import Example

EXAMPLES = {"vl_tower": "graph_exec.examples.vl_tower", "embed_lm": "graph_exec.examples.embed_lm"}


def load(name: str) -> Example:
    """The example called ``name``; unknown names raise ``ValueError`` listing the known ones."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; choose one of: {', '.join(EXAMPLES)}")
    return importlib.import_module(EXAMPLES[name]).EXAMPLE
