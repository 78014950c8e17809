"""``stats()`` of a schedule: the counters of every component of its set-up, in one dictionary.

Kept apart from :mod:`graph_exec.runtime.schedules` because it reads every component
(executor, transports, data parallelism, sharding, memory account, caches) and adds a key as
each grows one; ``docs/api.md`` lists every key.
"""

from __future__ import annotations

from typing import Any

from graph_exec.runtime.memory_account import parameter_bytes, tensors_bytes
from graph_exec.runtime.setup import Setup


def schedule_stats(sched: Any, setup: Setup) -> dict[str, Any]:
    """Compilations (the library's first calls per kernel and MindSpore's own count, ``None``
    where not exposed), the kernel cache, receive-buffer pool, messages, data parallelism,
    optimizer sharding and ``memory``."""
    compile_stats = setup.executor.compile_stats
    out: dict[str, Any] = {
        "compilations": compile_stats.compilations,
        "compile_seconds": compile_stats.compile_seconds,
        "mindspore_compilations": compile_stats.mindspore_compilations,
        "kernel_cache": {
            "size": sched.kernel_cache_size,
            "entries": compile_stats.cached_kernels,
            "evictions": compile_stats.evictions,
        },
        "pool": setup.slots.stats(),
    }
    if setup.transport is not None:
        out["transport"] = setup.transport.stats
    if setup.data_parallel is not None:
        out["data_parallel"] = setup.data_parallel.stats
    if setup.sharding is not None:
        out["optimizer_sharding"] = setup.sharding.stats
    out["memory"] = memory_stats(sched, setup)
    return out


def memory_stats(sched: Any, setup: Setup) -> dict[str, Any]:
    """``stats()["memory"]``: this rank's bytes."""
    from graph_exec.device import memory_peaks

    cells = [s.submodule for s in sched.stages]
    if sched.preprocess_module is not None and setup.plan.config.preprocess != "none":
        cells.append(sched.preprocess_module)  # the baseline's ranks but 0 ignore theirs
    return {
        "parameters": parameter_bytes(cells),
        "gradient_accumulators": tensors_bytes(setup.executor.grads().values()),
        "optimizer_state": None if sched._optimizer_state is None else sched._optimizer_state[1],
        "optimizer_parameters": tensors_bytes(sched.optimizer_params()),
        "zb_buffers": setup.executor.split_buffer_bytes,
        **setup.runtime.memory.peaks(),
        **setup.runtime.memory_prediction(sched.recompute),
        **memory_peaks(),
        "caches": cache_stats(sched, setup),
    }


def cache_stats(sched: Any, setup: Setup) -> dict[str, dict[str, Any]]:
    """``stats()["memory"]["caches"]``: what each per-shape cache of this rank keeps now and its
    bound (``docs/architecture.md``, "Caches and their bounds")."""
    transport = setup.transport
    compile_stats = setup.executor.compile_stats
    return {
        "send_frames": None if transport is None else transport.frames.cache_stats(),
        "receive_slots": setup.slots.cache_stats(),
        "kernels": {
            "entries": compile_stats.cached_kernels,
            "bytes": compile_stats.cached_bytes,
            "max_entries": sched.kernel_cache_size,
            "evictions": compile_stats.evictions,
        },
    }
