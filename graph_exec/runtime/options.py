"""The options of both schedules, declared, documented and checked once.

``ScheduleMPipeTranspose`` and ``ScheduleInterleaved1F1B`` take the same keyword options (the fair
baseline refuses the four that only mean something with transposition, :data:`MPIPE_ONLY`).
Each option is one field of :class:`ScheduleOptions` with its default and its documentation;
:meth:`ScheduleOptions.__post_init__` checks every value on its own and against the others
(what needs the model, such as whether the preprocess is trainable, the schedule checks).
The schedules' signatures and the option lists of their ``help()`` are made from these fields
(:func:`schedule_signature`, :func:`options_doc`), so an option is added in one place.

``overflow`` is the old name of ``run_ahead``: still accepted, with a ``DeprecationWarning``
(:func:`options_from_keywords`).
"""

from __future__ import annotations

import inspect
import textwrap
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from graph_exec import checks
from graph_exec.executors import DEFAULT_KERNEL_CACHE_SIZE, MODES
from graph_exec.executors.jit_callable import jit_parseable
from graph_exec.executors.jit_options import check_jit_options
from graph_exec.idle_buffers import DEFAULT_BUFFER_CACHE_BYTES
from graph_exec.runtime.loss_scaling import check_loss_scaler
from graph_exec.runtime.shapes import ShapeBuckets, check_shapes
from graph_exec.runtime.tied import check_pairs
from graph_exec.schedule.config import BACKWARD, BODY, INPUT, RUN_AHEAD
from graph_exec.schedule.placement import TOWER_ORDERS
from graph_exec.transport.buckets import DEFAULT_BUCKET_BYTES

#: The accepted ``loss_reduction`` values.
LOSS_REDUCTIONS = ("mean", "token")
#: Options that only mean something when the preprocess is transposed (refused by the baseline).
MPIPE_ONLY = ("run_ahead", "backward", "input", "keep_preprocess_tape")
#: Old option names still accepted, with a ``DeprecationWarning``: old name -> new name.
RENAMED = {"overflow": "run_ahead"}


def _doc(text: str) -> dict[str, str]:
    return {"doc": " ".join(text.split())}


@dataclass(frozen=True)
class ScheduleOptions:
    """The keyword options of :class:`~graph_exec.ScheduleMPipeTranspose` and
    :class:`~graph_exec.ScheduleInterleaved1F1B`, checked when made (a clear ``ValueError`` or
    ``TypeError`` naming the bad value and what is allowed). Users pass them as keyword
    arguments of the schedule; the schedule reads them back as attributes (``sched.mode``).
    """

    mode: str = field(
        default="graph", metadata=_doc('``"graph"`` (compiled) or ``"pynative"`` (eager, for debugging).')
    )
    run_ahead: str = field(
        default="full",
        metadata=_doc(
            """``"full"`` or ``"min"``: how far the transposed preprocess runs ahead of the
            pipeline (``full``: micro ``m`` is preprocessed by its owner ``m mod NT`` as early as
            it can; ``min``: only the first ``NT`` micro-batches are run ahead, the rest inline on
            rank 0; ``docs/schedule.md``). Old name ``overflow``, still accepted with a warning."""
        ),
    )
    backward: str = field(
        default="central",
        metadata=_doc('``"central"`` (preprocess backward on rank 0) or ``"owner"`` (on its owner).'),
    )
    input: str = field(
        default="replicated",
        metadata=_doc(
            """``"replicated"`` (every rank passes the whole batch) or ``"owned"`` (a rank's
            batch is read only for the micro-batches it owns; the rest reach rank 0 by transfer)."""
        ),
    )
    body: str = field(
        default="interleaved",
        metadata=_doc(
            """the pipeline body: ``"interleaved"`` (interleaved 1F1B), ``"1f1b"`` (plain 1F1B,
            one stage per rank), ``"gpipe"`` or ``"zb"`` (ZB-H1-style zero bubble: each backward
            split into ``I``, the input gradient the upstream rank waits for, and ``W``, the
            weight gradients, deferred into the bubbles; ``docs/schedule.md``, "Zero bubble").
            With ``"zb"`` ``I`` holds, until ``W``, the inputs and output gradients of the
            chunk's split linear layers and the weight gradients of its other parameters
            (``docs/architecture.md``, "The split backward"); it cannot be combined with
            ``recompute=True`` or ``shapes="dynamic"``, under which ``I`` would hold a whole
            copy of the chunk's weight gradients per pending ``W``."""
        ),
    )
    loss_fn: Callable[..., Any] | None = field(
        default=None,
        metadata=_doc(
            """``loss_fn(output, *labels)``; ``None``: the last chunk returns the loss. In graph
            mode an inline lambda is rewritten for ``mindspore.jit``; one without source is refused."""
        ),
    )
    scale_grads: bool = field(
        default=False,
        metadata=_doc('divide the gradients by ``micro_batch_num`` (``loss_reduction="mean"``).'),
    )
    timeout_s: float = field(default=300.0, metadata=_doc("bound, in seconds, on every wait for a peer."))
    compile_timeout_s: float | None = field(
        default=None,
        metadata=_doc(
            """bound, in seconds, on the waits of a step in which a peer may be compiling (the
            first ``run()``/``evaluate()``, one with shapes not run before, and the ``step()``
            after it), at least ``timeout_s``; ``None``: ``timeout_s`` where MindSpore's back end
            ends the waits itself (CPU with its fast paths, whose compiles take seconds), else
            1800 (``graph_exec.runtime.wait_bounds``)."""
        ),
    )
    sync_steps: bool | None = field(
        default=None,
        metadata=_doc(
            """wait for each compute step's results before the next, so ``timeline`` shows each
            step's own time; ``None``: the device policy's default (on for CPU, where it was
            measured 2-3x faster; off on devices and with the CPU fast paths off)."""
        ),
    )
    mesh: Any = field(
        default=None,
        metadata=_doc(
            """a :class:`~graph_exec.DeviceMesh` (this rank is pipeline rank ``mesh.pp_rank`` of
            replica ``mesh.dp_rank``); ``None``: one pipeline over the whole world."""
        ),
    )
    dp_bucket_bytes: int = field(
        default=DEFAULT_BUCKET_BYTES,
        metadata=_doc("size of the flat buckets in which gradients are averaged over ``mesh.dp``."),
    )
    optimizer_sharding: bool = field(
        default=False,
        metadata=_doc(
            """ZeRO-1: each of the ``mesh.dp`` replicas keeps the optimizer state of its share of
            the parameters (build the optimizer over ``sched.optimizer_params()``; ``step()``
            gives every replica the updated values; ``docs/zero.md``). Needs ``mesh.dp >= 2``."""
        ),
    )
    recompute: bool = field(
        default=False,
        metadata=_doc(
            """``False``: a stage's backward runs the bprop of its taped forward; ``True``: keep
            only its inputs and record the forward again (less activation memory)."""
        ),
    )
    keep_preprocess_tape: bool = field(
        default=False,
        metadata=_doc(
            """opt-in, for a trainable preprocess: record each ``TFWD`` whose backward runs on
            the same rank (owner backward: every owner's micro-batches; central: rank 0's own)
            under the tape, so that backward runs the recorded bprop instead of recomputing the
            preprocess. Costs the preprocess activations of those micro-batches, held from
            ``TFWD`` to their backward; cannot be combined with ``recompute=True``."""
        ),
    )
    measure_tape: bool = field(
        default=False,
        metadata=_doc(
            """opt-in: on the first step, measure what each local stage's recorded forward keeps
            in MindSpore's tape and what one of its backwards needs while it runs (a few extra
            forwards and one backward per stage, released at once, their gradients put back), so
            that ``stats()["memory"]`` shows ``tape_bytes_per_micro``,
            ``backward_transient_bytes`` and a ``predicted_peak`` that includes the tapes the
            plan holds and the largest transient (``docs/memory.md``, "At run time")."""
        ),
    )
    loss_reduction: str = field(
        default="mean",
        metadata=_doc(
            """``"mean"``: ``loss_fn`` returns a scalar per micro-batch, the gradients are summed
            over micro-batches (their mean with ``scale_grads``); ``"token"``: ``loss_fn`` returns
            ``(sum_of_token_losses, token_count)`` and the gradients are those of
            ``Σ sums / Σ counts`` over every micro-batch of every replica."""
        ),
    )
    loss_scaler: Any = field(
        default=None,
        metadata=_doc(
            """``mindspore.amp.DynamicLossScaler`` or ``StaticLossScaler``: the last stage scales
            the loss (a graph input), the gradients are unscaled after the step, every rank of the
            mesh gets one overflow verdict (``grads_finite``) and the scaler is adjusted with it
            after every ``run()``."""
        ),
    )
    tied_parameters: Sequence[tuple[str, str]] | None = field(
        default=None,
        metadata=_doc(
            """pairs of parameter names (as on their ranks) that are one weight, e.g.
            ``[("embed.table.embedding_table", "head.weight")]``: checked equal at the first
            step, their gradients summed between the ranks holding them after every step,
            counted once by ``clip_grad_norm``."""
        ),
    )
    shapes: str = field(
        default="static",
        metadata=_doc(
            """``"static"`` (every new shape compiles its kernels) or ``"buckets"``: every
            positional input and label is padded along each dim of ``shape_buckets`` up to the
            smallest bucket that holds it, and the loss gets one float32 mask per dim after the
            labels, ``loss_fn(output, *labels, *masks)`` (1 on real positions); at most one
            compilation per bucket. ``"dynamic"``: nothing padded; each kernel compiles a static
            graph for its first shape and one dynamic-shape graph for every other size (two
            compilations per kernel, plus one static graph for a shape that keeps coming back;
            ``docs/shapes.md``)."""
        ),
    )
    shape_buckets: Mapping[int, Sequence[int]] | None = field(
        default=None,
        metadata=_doc(
            """``{dim: sizes}`` with ``shapes="buckets"``, e.g. ``{1: (64, 128, 256)}`` for the
            sequence dim: a dim >= 1, sizes strictly increasing; a length above the largest
            bucket is an error."""
        ),
    )
    shape_pad_value: float = field(
        default=0, metadata=_doc("what padded positions of inputs and labels hold.")
    )
    kernel_cache_size: int = field(
        default=DEFAULT_KERNEL_CACHE_SIZE,
        metadata=_doc(
            """how many compiled kernels the executor keeps (least recently used evicted first;
            ``stats()`` counts the evictions)."""
        ),
    )
    buffer_cache_bytes: int = field(
        default=DEFAULT_BUFFER_CACHE_BYTES,
        metadata=_doc(
            """idle message memory a rank keeps for reuse, per cache (send frames, receive
            slots; default 1 GiB): shapes that change from step to step leave buffers of every
            size behind, and past this bound the least recently used are freed
            (``stats()["memory"]["caches"]`` shows each cache; ``docs/architecture.md``, "Caches
            and their bounds"). ``0`` keeps none; a bound below one step's messages makes every
            step allocate again (and, on a device, wait for a freed slot's readers)."""
        ),
    )
    jit_options: Mapping[str, Any] | None = field(
        default=None,
        metadata=_doc(
            """compiler options handed to every ``mindspore.jit`` the library makes (graph mode),
            e.g. ``{"jit_level": "O1"}``; keys: ``jit_level`` (``"O0"``, ``"O1"``), ``backend``,
            ``fullgraph``, ``exec_order``, ``disable_format_transform``. ``None``: MindSpore's
            defaults. ``docs/api.md`` says what the levels mean on Ascend."""
        ),
    )
    tower_order: str = field(
        default="arrival",
        metadata=_doc(
            """``"arrival"`` (micro-batch ``m`` of the batch runs as plan micro ``m``) or
            ``"balanced"``: each step places the micro-batches by their preprocess cost, given as
            ``run(..., tower_costs=[...])`` (``docs/schedule.md``, "Tower placement"); the losses
            still come back in the batch's order. Needs a preprocess. With ``input="owned"`` an
            owner must hold the micro-batches placed on it (``owned_input(tower_costs)``; the
            owned-input ``graph_exec.data.DataLoader`` reads exactly those after one exchange of
            sizes). The default stays ``"arrival"`` until balanced is measured no slower."""
        ),
    )
    #: The padding of ``shapes="buckets"`` (``None`` otherwise), made from the three shape options.
    bucketing: ShapeBuckets | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        mode = checks.choice("mode", self.mode, MODES)
        checks.choice("run_ahead", self.run_ahead, RUN_AHEAD)
        checks.choice("backward", self.backward, BACKWARD)
        checks.choice("input", self.input, INPUT)
        checks.choice("body", self.body, BODY)
        self._set("loss_fn", _check_loss_fn(self.loss_fn, mode))
        self._set("scale_grads", bool(self.scale_grads))
        self._set("timeout_s", checks.positive_seconds("timeout_s", self.timeout_s))
        if self.compile_timeout_s is not None:
            compile_s = checks.positive_seconds("compile_timeout_s", self.compile_timeout_s)
            if compile_s < self.timeout_s:
                raise ValueError(
                    f"compile_timeout_s={compile_s:g} is shorter than timeout_s={self.timeout_s:g}: it "
                    "bounds the waits while a peer may be compiling, which take at least as long"
                )
            self._set("compile_timeout_s", compile_s)
        _check_mesh(self.mesh)
        checks.positive_int("dp_bucket_bytes", self.dp_bucket_bytes)
        _check_optimizer_sharding(self.optimizer_sharding, self.mesh)
        checks.boolean("recompute", self.recompute)
        checks.boolean("keep_preprocess_tape", self.keep_preprocess_tape)
        checks.boolean("measure_tape", self.measure_tape)
        if self.keep_preprocess_tape and self.recompute:
            raise ValueError(
                "keep_preprocess_tape=True and recompute=True contradict each other: the first keeps "
                "the preprocess activations to skip a recompute, the second recomputes to save them"
            )
        _check_split_backward(self.body, self.recompute, self.shapes)
        checks.choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        if self.loss_reduction == "token" and self.scale_grads:
            raise ValueError(
                "scale_grads=True divides by the micro-batch count and loss_reduction='token' by the "
                "global token count: pass one of them"
            )
        check_loss_scaler(self.loss_scaler)
        self._set("tied_parameters", check_pairs(self.tied_parameters))
        self._set("bucketing", check_shapes(self.shapes, self.shape_buckets, self.shape_pad_value))
        checks.positive_int("kernel_cache_size", self.kernel_cache_size)
        checks.non_negative_int("buffer_cache_bytes", self.buffer_cache_bytes)
        self._set("jit_options", check_jit_options(self.jit_options))
        checks.choice("tower_order", self.tower_order, TOWER_ORDERS)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ normalises


def _check_split_backward(body: str, recompute: bool, shapes: str) -> None:
    """Refuse what would make ``body="zb"`` hold a whole copy of a chunk's weight gradients from
    every ``I`` to its ``W`` (up to 8-14 pending per rank): the split layers' probes are shaped
    for one signature of a recorded forward, so a recomputed forward, or one of dynamic shape,
    gets no split and its ``I`` computes every weight gradient at once."""
    if body != "zb":
        return
    if recompute:
        raise ValueError(
            "body='zb' and recompute=True cannot be combined: a recomputed forward is not split, so "
            "each I would hold a whole copy of its chunk's weight gradients until its W; use "
            "body='interleaved' with recompute=True, or body='zb' without recompute"
        )
    if shapes == "dynamic":
        raise ValueError(
            "body='zb' and shapes='dynamic' cannot be combined: the split layers' buffers are "
            "shaped per input shape, so each I would hold a whole copy of its chunk's weight "
            "gradients until its W; use shapes='buckets' (or 'static') with body='zb', or "
            "body='interleaved' with shapes='dynamic'"
        )


def _check_loss_fn(loss_fn: Callable[..., Any] | None, mode: str) -> Callable[..., Any] | None:
    """``loss_fn``, rewritten in graph mode into a function ``mindspore.jit`` can parse."""
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    return jit_parseable(loss_fn) if mode == "graph" else loss_fn


def _check_mesh(mesh: Any) -> None:
    if mesh is not None:
        from graph_exec.transport.mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a graph_exec.DeviceMesh or None, got {type(mesh).__name__}")


def _check_optimizer_sharding(sharding: Any, mesh: Any) -> None:
    """``optimizer_sharding=True`` shards over the data-parallel replicas: it needs ``D >= 2``."""
    checks.boolean("optimizer_sharding", sharding)
    dp = 1 if mesh is None else mesh.dp_size
    if sharding and dp < 2:
        raise ValueError(
            f"optimizer_sharding=True shards the optimizer state over the data-parallel replicas, but "
            f"the mesh has dp={dp} ({'mesh=None: one pipeline' if mesh is None else 'mesh.dp_size'}): pass "
            "mesh=DeviceMesh(dp=D) with D >= 2 (on the command line: --dp D with --zero 1), or "
            "optimizer_sharding=False"
        )


def option_names(transposes: bool = True) -> tuple[str, ...]:
    """The keyword options of a schedule (without the MPipe-only ones when it does not transpose)."""
    return tuple(
        f.name for f in fields(ScheduleOptions) if f.init and (transposes or f.name not in MPIPE_ONLY)
    )


def options_from_keywords(keywords: dict[str, Any], schedule: str, transposes: bool) -> ScheduleOptions:
    """The checked options of a ``schedule(...)`` call's keyword arguments.

    ``overflow`` is taken for ``run_ahead`` with a ``DeprecationWarning`` (both: an error). A
    schedule that does not transpose refuses the MPipe-only options, an unknown name is refused
    with the list of options.
    """
    keywords = dict(keywords)
    for old, new in RENAMED.items():
        if old in keywords:
            if new in keywords:
                raise TypeError(f"{schedule}: pass {new}= or its old name {old}=, not both")
            if transposes:
                warnings.warn(
                    f"{schedule}: the option {old}= is now called {new}=; {old}= will be removed",
                    DeprecationWarning,
                    stacklevel=3,  # the caller of the schedule's constructor
                )
                keywords[new] = checks.choice(old, keywords.pop(old), RUN_AHEAD)
    if not transposes:
        refused = [name for name in keywords if name in MPIPE_ONLY or name in RENAMED]
        if refused:
            raise TypeError(
                f"{schedule} does not transpose the preprocess (rank 0 runs all of it), so "
                f"{', '.join(refused)} do not apply: drop them, or use ScheduleMPipeTranspose"
            )
    unknown = sorted(set(keywords) - set(option_names(transposes)))
    if unknown:
        raise TypeError(
            f"{schedule} got unexpected keyword argument(s) {unknown}; its options are: "
            f"{', '.join(option_names(transposes))}"
        )
    return ScheduleOptions(**keywords)


def schedule_signature(transposes: bool) -> inspect.Signature:
    """The signature a schedule's ``help()`` shows: its positional arguments, then every option."""
    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    positional = [
        inspect.Parameter("stages", plain, annotation="PipelineStage | Sequence[PipelineStage]"),
        inspect.Parameter("micro_batch_num", plain, annotation="int"),
        inspect.Parameter("preprocess_module", plain, default=None, annotation="Any"),
        inspect.Parameter("num_transpose_layers", plain, default=0, annotation="int"),
    ]
    by_name = {f.name: f for f in fields(ScheduleOptions)}
    keyword = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=by_name[name].default, annotation=by_name[name].type
        )
        for name in option_names(transposes)
    ]
    return inspect.Signature([*positional, *keyword], return_annotation=None)


def options_doc(transposes: bool = True, indent: str = "    ") -> str:
    """The option list of a docstring, from the fields' documentation."""
    lines = []
    by_name = {f.name: f for f in fields(ScheduleOptions)}
    for name in option_names(transposes):
        text = f"{name}: {by_name[name].metadata['doc']}"
        lines.append(textwrap.fill(text, 96, initial_indent=indent * 2, subsequent_indent=indent * 3))
    return "\n".join(lines)


ScheduleOptions.__doc__ = f"{ScheduleOptions.__doc__.rstrip()}\n\n    Options:\n{options_doc()}\n"
