"""The schema of the ``graph-exec bench --json`` document, as a checker.

The layout is documented in :mod:`graph_exec.report.bench_report`; :func:`check` lists every
departure from it (missing or unexpected keys, wrong types), so a test or a consumer can
validate a file without a JSON-schema library. Documents of version 2, written before
``overflow`` was renamed ``run_ahead``, are checked with the old key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graph_exec.report.bench_report import DEFINITIONS, SCHEMA, VERSION

_NUM = (int, float)
_MAYBE_NUM = (int, float, type(None))
_COSTS = {
    "forward_s": _NUM,
    "backward_s": _NUM,
    "preprocess_forward_s": _NUM,
    "recompute_s": _NUM,
    "preprocess_backward_s": _NUM,
    "broadcast_s": _NUM,
    "allreduce_s": _NUM,
    "latency_s": _NUM,
    "bandwidth_bytes_per_s": _MAYBE_NUM,
    "activation_bytes": _NUM,
    "preprocess_bytes": _NUM,
    "fused_last_stage": bool,
    "stage_forward_s": [_NUM],
    "stage_backward_s": [_NUM],
}
_MPIPE = {
    "nt": int,
    "pf_s": _MAYBE_NUM,
    "saving_s": _MAYBE_NUM,
    "simulated_saving_s": _MAYBE_NUM,
    "saving_over_simulated": _MAYBE_NUM,
    "theory_saving_s": _MAYBE_NUM,
    "saving_share": _MAYBE_NUM,
}
_RUN = {
    "name": str,
    "variant": str,
    "mode": str,
    "baseline": bool,
    "preprocess": str,
    "run_ahead": str,
    "backward": str,
    "keep_preprocess_tape": bool,
    "step_time_s": _NUM,
    "step_times_s": [_NUM],
    "baseline_run": (str, type(None)),
    "ratio_to_baseline": _MAYBE_NUM,
    "pynative_over_graph": _MAYBE_NUM,
    "bubble_fraction": _NUM,
    "overhead_fraction": _NUM,
    "dispatch_s": _NUM,
    "compilations": int,
    "compile_s": _NUM,
    "allocations_after_warmup": int,
    "losses": [_NUM],
    "prediction": {"step_time_s": _NUM, "error": _NUM, "bubble_fraction": _NUM, "costs": _COSTS},
    "mpipe": (_MPIPE, type(None)),
}
_DOCUMENT = {
    "schema": str,
    "version": int,
    "created": str,
    "environment": {"python": str, "mindspore": str, "graph_exec": str, "cpus": int},
    "job": {
        "example": str,
        "size": str,
        "ranks": int,
        "dp": int,
        "vpp": int,
        "micro": int,
        "batch": int,
        "steps": int,
        "warmup": int,
        "lr": _NUM,
        "variants": [str],
        "modes": [str],
    },
    "definitions": {key: str for key in DEFINITIONS},
    "runs": [_RUN],
}
#: The document shape of each version read: version 2 named a run's ``run_ahead`` ``overflow``.
_SHAPES = {
    VERSION: _DOCUMENT,
    2: {**_DOCUMENT, "runs": [{("overflow" if k == "run_ahead" else k): v for k, v in _RUN.items()}]},
}


def check(doc: Any) -> list[str]:
    """Every way ``doc`` departs from the schema of its version (empty: it conforms)."""
    version = doc.get("version") if isinstance(doc, Mapping) else None
    shape = _SHAPES.get(version, _DOCUMENT) if type(version) is int else _DOCUMENT  # bool is no version
    problems = _check(doc, shape, "$")
    if not problems and (doc["schema"] != SCHEMA or doc["version"] not in _SHAPES):
        problems.append(
            f"$: expected schema {SCHEMA!r} version {VERSION} (or 2), got {doc['schema']!r} {doc['version']}"
        )
    return problems


def _check(value: Any, shape: Any, where: str) -> list[str]:
    if isinstance(shape, Mapping):
        if not isinstance(value, Mapping):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        problems = [f"{where}: missing {key!r}" for key in shape if key not in value]
        problems += [f"{where}: unexpected {key!r}" for key in value if key not in shape]
        for key in shape.keys() & value.keys():
            problems += _check(value[key], shape[key], f"{where}.{key}")
        return problems
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [p for i, item in enumerate(value) for p in _check(item, shape[0], f"{where}[{i}]")]
    if isinstance(shape, tuple) and any(isinstance(s, Mapping) for s in shape):  # object or null
        return [] if value is None else _check(value, next(s for s in shape if isinstance(s, Mapping)), where)
    allowed = shape if isinstance(shape, tuple) else (shape,)
    # bool is an int subclass: only accept it where bool is asked for
    if isinstance(value, bool) and bool not in allowed:
        return [f"{where}: expected {_names(allowed)}, got bool"]
    if not isinstance(value, allowed):
        return [f"{where}: expected {_names(allowed)}, got {type(value).__name__}"]
    return []


def _names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)
