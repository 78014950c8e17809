"""What a training loop needs, on real ranks, against the single-process reference.

One msrun launch per suite (``p2``, ``p4``: one pipeline over the world; ``mesh``: dp2 x pp2).
Every rank builds the whole model (same seed), keeps its own chunks, and compares what it
holds with a non-pipelined reference it computes itself: per-micro losses on the last stage's
rank, every gradient it trains (atol 1e-5 / rtol 1e-4; float16 and bfloat16 within
``LOW_PRECISION_TOLERANCE``), global norms (rtol 1e-5, and bit-identical on every rank of the
job), per-token gradients, evaluation losses and outputs, tied weights that stay one weight,
and one overflow verdict for the whole mesh. A failed comparison is printed and counted, not
raised, so the ranks stay in step; the bad-input cases run last (a failed step ends a
schedule).

Usage: ``training_loop_checks.py SUITE`` with SUITE one of :data:`SUITES`.
"""

from __future__ import annotations

import math
import sys
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import amp, nn
from mindspore.communication import get_rank, init

import graph_exec as ge
from graph_exec.errors import (
    ConfigurationMismatchError,
    GraphExecError,
    NonFiniteGradientError,
    RemoteRankError,
    TiedCopiesDriftError,
)
from graph_exec.msenv import prepare_mindspore
from graph_exec.runtime.grad_norm import NonFiniteGradientWarning
from graph_exec.transport import all_gather_objects
from tests.models.common import ATOL, RTOL, announce_policy, loss_fn
from tests.models.pipeline import batch, build, reference, sgd_step
from tests.models.training import (
    LOW_PRECISION_TOLERANCE,
    build_gated,
    build_low_precision,
    build_tied,
    global_norm,
    padding_mask,
    tie,
    tied_batch,
    token_loss,
    token_reference,
)
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite

TIMEOUT_S = 60.0


@dataclass
class Rank:
    """Where this process sits, and its checker."""

    checker: Checker
    mesh: ge.DeviceMesh
    results: dict = field(default_factory=dict)

    @property
    def pp(self) -> int:
        return self.mesh.pp_size

    @property
    def pp_rank(self) -> int:
        return self.mesh.pp_rank

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checker.check(name, ok, detail)

    def close(self, name: str, actual: dict, expected: dict, atol: float = ATOL, rtol: float = RTOL) -> None:
        worst = ""
        if set(actual) != set(expected):
            worst = f"names differ: {sorted(actual)} vs {sorted(expected)}"
        for key in sorted(set(actual) & set(expected)):
            if not worst and not np.allclose(actual[key], expected[key], atol=atol, rtol=rtol):
                worst = f"{key}: max |diff| {np.abs(actual[key] - expected[key]).max():.3g}"
        self.check(name, bool(expected) and not worst, worst)

    def losses(self, name: str, losses, expected, atol: float = ATOL, rtol: float = RTOL) -> None:
        self.check(f"{name}.losses_where_expected", (losses is not None) == self.last)
        if self.last:
            got = np.array([float(x.asnumpy()) for x in losses])
            self.check(
                f"{name}.losses", np.allclose(got, expected, atol=atol, rtol=rtol), f"{got} vs {expected}"
            )

    def same_everywhere(self, name: str, value: float) -> None:
        """``value`` is bit-identical on every rank of the job."""
        everyone = all_gather_objects(value, TIMEOUT_S, f"comparing {name}")
        self.check(name, len(set(everyone)) == 1, f"{everyone}")


@dataclass(frozen=True)
class Case:
    """One check of a suite: its name (the prefix of its CHECK lines) and what it runs."""

    name: str
    run: Callable[[Rank], None]


def stages_of(model, ctx: Rank) -> list:
    n = len(model.stages)
    return [ge.PipelineStage(model.stages[s], s, n) for s in range(ctx.pp_rank, n, ctx.pp)]


def make(model, ctx: Rank, micro: int, baseline: bool = False, **options):
    options = {"loss_fn": loss_fn, "timeout_s": TIMEOUT_S, "mesh": ctx.mesh, **options}
    stages, layers = stages_of(model, ctx), 0 if model.preprocess is None else 1
    if baseline:
        return ge.ScheduleInterleaved1F1B(stages, micro, model.preprocess, layers, **options)
    return ge.ScheduleMPipeTranspose(stages, micro, model.preprocess, layers, **options)


def trained(sched, expected: dict) -> dict:
    """``expected`` restricted to what this rank trains."""
    names = {p.name for p in sched.trainable_params()}
    return {k: v for k, v in expected.items() if k in names}


def share(ctx: Rank, *tensors):
    """This replica's rows of global-batch tensors (all of them without data parallelism)."""
    rows = tensors[0].shape[0] // ctx.mesh.dp_size
    mine = slice(ctx.mesh.dp_rank * rows, (ctx.mesh.dp_rank + 1) * rows)
    return tuple(t[mine] for t in tensors)


def mine(ctx: Rank, values: list, micro: int) -> list:
    """This replica's entries of per-micro-batch reference values of the global batch."""
    return values[ctx.mesh.dp_rank * micro : (ctx.mesh.dp_rank + 1) * micro]


def crc(param) -> int:
    return zlib.crc32(np.ascontiguousarray(param.asnumpy()).tobytes())


# -- cases -----------------------------------------------------------------------------------


def pipeline_meetings(sched) -> int:
    """How many all-reduces this rank's pipeline group has run."""
    return sched.stats()["transport"].all_reduces


def clip_case(name: str, preprocess: str = "trainable", vpp: int = 1, micro: int = 4, **options) -> Case:
    """Norm (2, 1, inf) equal to the reference's global norm and the same bits on every rank,
    clipped gradients equal to the reference's times the coefficient, then step() with clipping
    and a second step against the reference doing the same."""

    def run(ctx: Rank) -> None:
        stages = ctx.pp * vpp
        model, ref = build(stages, preprocess), build(stages, preprocess)
        sched = make(model, ctx, micro, scale_grads=True, **options)
        optimizer = nn.SGD(sched.trainable_params(), learning_rate=0.5)
        dp, size = ctx.mesh.dp_size, 2 * micro * ctx.mesh.dp_size
        for step in range(2):
            x, labels = batch(size, seed=10 + step)
            ref_losses, full = reference(ref, x, labels, dp * micro, scale=1 / (dp * micro))
            x_mine, labels_mine = share(ctx, x, labels)
            ctx.losses(
                f"{name}.step{step}", sched.run(x_mine, labels=labels_mine), mine(ctx, ref_losses, micro)
            )
            ctx.close(f"{name}.step{step}.grads", grads_numpy(sched), trained(sched, full))
            if step == 0:
                for norm_type in (2.0, 1.0, math.inf):
                    norm = sched.clip_grad_norm(math.inf, norm_type=norm_type)
                    want = global_norm(full, norm_type)
                    ctx.check(
                        f"{name}.norm_{norm_type}",
                        math.isclose(norm, want, rel_tol=1e-5),
                        f"{norm} vs {want}",
                    )
                    ctx.same_everywhere(f"{name}.norm_{norm_type}_same_bits_everywhere", norm)
            max_norm = 0.3 * global_norm(full)
            coefficient = max_norm / (global_norm(full) + 1e-6)
            clipped = {k: coefficient * v for k, v in full.items()}
            if step == 0:  # clip, check the clipped gradients, then step() applies them
                norm = sched.clip_grad_norm(max_norm)
                ctx.check(
                    f"{name}.clip_returns_the_norm", math.isclose(norm, global_norm(full), rel_tol=1e-5)
                )
                ctx.close(f"{name}.clipped_grads", grads_numpy(sched), trained(sched, clipped))
                outcome = sched.step(optimizer)
                ctx.check(f"{name}.step_without_max_norm", outcome["grad_norm"] is None, f"{outcome}")
            else:  # step() clips itself
                outcome = sched.step(optimizer, max_norm=max_norm)
                ctx.check(
                    f"{name}.step{step}.grad_norm",
                    math.isclose(outcome["grad_norm"], global_norm(full), rel_tol=1e-5),
                    f"{outcome}",
                )
            sgd_step(ref.params(), clipped, 0.5)
        if "loss_scaler" in options:  # a third step, gradients not read: the norm rides with the check
            x, labels = batch(size, seed=12)
            ref_losses, full = reference(ref, x, labels, dp * micro, scale=1 / (dp * micro))
            x_mine, labels_mine = share(ctx, x, labels)
            ctx.losses(f"{name}.step2", sched.run(x_mine, labels=labels_mine), mine(ctx, ref_losses, micro))
            meetings = pipeline_meetings(sched) if ctx.pp > 1 else 0
            outcome = sched.step(optimizer, max_norm=0.3 * global_norm(full))
            ctx.check(
                f"{name}.step2.grad_norm",
                math.isclose(outcome["grad_norm"], global_norm(full), rel_tol=1e-5),
                f"{outcome}",
            )
            ctx.same_everywhere(f"{name}.step2.norm_same_bits_everywhere", outcome["grad_norm"])
            if ctx.pp > 1:
                ctx.check(
                    f"{name}.step2.clip_needs_no_collective_of_its_own",
                    pipeline_meetings(sched) == meetings,
                    f"{meetings} -> {pipeline_meetings(sched)} all-reduces",
                )

    return Case(name, run)


def tied_case(name: str, vpp: int = 1, **options) -> Case:
    """An embedding (preprocess) tied to the head (last stage): summed gradients on both
    ranks, the norm counting the pair once, one weight after two clipped steps."""

    def run(ctx: Rank) -> None:
        (model, pair), (ref, _) = build_tied(ctx.pp * vpp), build_tied(ctx.pp * vpp)
        micro, dp = 4, ctx.mesh.dp_size
        sched = make(model, ctx, micro, scale_grads=True, tied_parameters=[pair], **options)
        optimizer = nn.SGD(sched.optimizer_params(), learning_rate=0.5)
        for step in range(2):
            x, labels = tied_batch(2 * micro * dp, seed=20 + step)
            ref_losses, grads = reference(ref, x, labels, dp * micro, scale=1 / (dp * micro))
            full = tie(grads, pair)
            x_mine, labels_mine = share(ctx, x, labels)
            ctx.losses(
                f"{name}.step{step}", sched.run(x_mine, labels=labels_mine), mine(ctx, ref_losses, micro)
            )
            ctx.close(f"{name}.step{step}.grads", grads_numpy(sched), trained(sched, full))
            norm = global_norm(full, skip=(pair[1],))
            outcome = sched.step(optimizer, max_norm=0.5 * norm)
            ctx.check(
                f"{name}.step{step}.norm_counts_the_pair_once",
                math.isclose(outcome["grad_norm"], norm, rel_tol=1e-5),
                f"{outcome} vs {norm}",
            )
            ctx.same_everywhere(f"{name}.step{step}.norm_same_bits_everywhere", outcome["grad_norm"])
            coefficient = 0.5 * norm / (norm + 1e-6)
            sgd_step(ref.params(), {k: coefficient * v for k, v in full.items()}, 0.5)
            values = {p.name: crc(p) for p in sched.trainable_params() if p.name in pair}
            everyone = all_gather_objects(values, TIMEOUT_S, "tied weights")
            held = {crc for rank_values in everyone for crc in rank_values.values()}
            ctx.check(f"{name}.step{step}.tied_weights_stay_one", len(held) == 1, f"{everyone}")

    return Case(name, run)


def token_case(name: str, micro: int = 4, **options) -> Case:
    """Per-token loss with micro-batches (and replicas) of different token counts: gradients of
    all token losses over all tokens, ``sum / count`` per micro-batch, with a static scaler."""

    def run(ctx: Rank) -> None:
        model, ref = build(ctx.pp, "trainable"), build(ctx.pp, "trainable")
        sched = make(
            model,
            ctx,
            micro,
            loss_fn=token_loss,
            loss_reduction="token",
            loss_scaler=amp.StaticLossScaler(4),
            **options,
        )
        dp = ctx.mesh.dp_size
        x, labels = batch(2 * micro * dp, seed=30)
        mask = padding_mask(2 * micro * dp, micro * dp, seed=31)
        ref_losses, expected, _ = token_reference(ref, x, labels, mask, micro * dp)
        x_mine, labels_mine, mask_mine = share(ctx, x, labels, mask)
        want = global_norm(expected)
        for step in range(2):  # the second step's norm rides with its token count, times D / N
            ctx.losses(
                f"{name}.step{step}",
                sched.run(x_mine, labels=(labels_mine, mask_mine)),
                mine(ctx, ref_losses, micro),
            )
            if step == 0:  # not at step 1: grads() hands the gradients out, and clip measures afresh
                ctx.close(f"{name}.grads", grads_numpy(sched), trained(sched, expected))
            ctx.check(f"{name}.step{step}.finite", sched.grads_finite is True)
            meetings = pipeline_meetings(sched) if ctx.pp > 1 else 0
            norm = sched.clip_grad_norm(math.inf)
            ctx.check(f"{name}.step{step}.norm", math.isclose(norm, want, rel_tol=1e-5), f"{norm} vs {want}")
            if step == 1 and ctx.pp > 1:
                ctx.check(
                    f"{name}.step1.norm_without_a_collective_of_its_own",
                    pipeline_meetings(sched) == meetings,
                    f"{meetings} -> {pipeline_meetings(sched)} all-reduces",
                )
            sched.zero_grad()

    return Case(name, run)


def evaluate_case(
    name: str, preprocess: str = "trainable", vpp: int = 1, micro: int = 4, baseline: bool = False, **options
) -> Case:
    """After a training step and an optimizer update on every rank: evaluation losses and
    outputs equal the updated reference's forward (the replicas got the new preprocess
    weights), and the gradients (kept, not zeroed) are untouched bit for bit."""

    def run(ctx: Rank) -> None:
        stages = ctx.pp * vpp
        model, ref = build(stages, preprocess), build(stages, preprocess)
        sched = make(model, ctx, micro, baseline=baseline, scale_grads=True, **options)
        dp = ctx.mesh.dp_size
        x, labels = batch(2 * micro * dp, seed=40)
        _, full = reference(ref, x, labels, dp * micro, scale=1 / (dp * micro))
        x_mine, labels_mine = share(ctx, x, labels)
        sched.run(x_mine, labels=labels_mine)
        nn.SGD(sched.trainable_params(), learning_rate=0.5)(tuple(sched.grads().values()))
        sgd_step(ref.params(), full, 0.5)
        held = grads_numpy(sched)
        x2, labels2 = batch(2 * micro * dp, seed=41)
        ref_losses, _ = reference(ref, x2, labels2, dp * micro)
        x2_mine, labels2_mine = share(ctx, x2, labels2)
        ctx.losses(f"{name}.eval", sched.evaluate(x2_mine, labels=labels2_mine), mine(ctx, ref_losses, micro))
        outputs = sched.evaluate(x2_mine)
        if ctx.last:
            rows = x2_mine.shape[0] // micro
            worst = 0.0
            for m, output in enumerate(outputs):
                h = x2_mine[m * rows : (m + 1) * rows]
                h = ref.preprocess(h) if ref.preprocess is not None else h
                for stage in ref.stages:
                    h = stage(*h) if isinstance(h, tuple) else stage(h)
                if not np.allclose(output.asnumpy(), h.asnumpy(), atol=ATOL, rtol=RTOL):
                    worst = max(worst, float(np.abs(output.asnumpy() - h.asnumpy()).max()))
            ctx.check(f"{name}.outputs", worst == 0.0, f"max |diff| {worst}")
        ctx.close(f"{name}.grads_untouched", grads_numpy(sched), held, atol=0, rtol=0)
        ctx.check(f"{name}.nothing_kept", not sched._setup.executor.kept())

    return Case(name, run)


def accumulate_case(name: str, **options) -> Case:
    """Two runs without zero_grad under a dynamic scaler that doubles between them (window 1):
    the sum of both references (each step unscaled by its own scale)."""

    def run(ctx: Rank) -> None:
        model, ref = build(ctx.pp, "trainable"), build(ctx.pp, "trainable")
        scaler = amp.DynamicLossScaler(2.0**8, 2, 1)
        sched = make(model, ctx, 4, loss_scaler=scaler, **options)
        total = None
        for step in range(2):
            x, labels = batch(8, seed=50 + step)
            _, full = reference(ref, x, labels, 4)
            sched.run(x, labels=labels)
            total = full if total is None else {k: total[k] + v for k, v in full.items()}
            ctx.close(f"{name}.run{step}.accumulated", grads_numpy(sched), trained(sched, total))
        ctx.check(f"{name}.scale_doubled_twice", float(scaler.scale_value.asnumpy()) == 1024.0)

    return Case(name, run)


def low_precision_case(name: str, dtype, **options) -> Case:
    """float16 / bfloat16 activations and cotangents over the transport, float32 accumulators."""

    def run(ctx: Rank) -> None:
        model, ref = build_low_precision(2 * ctx.pp, dtype), build_low_precision(2 * ctx.pp, dtype)
        sched = make(model, ctx, 4, loss_scaler=amp.DynamicLossScaler(2.0**4, 2, 1000), **options)
        x, labels = batch(8, seed=60)
        ref_losses, full = reference(ref, x, labels, 4)
        atol, rtol = LOW_PRECISION_TOLERANCE[dtype]
        ctx.losses(name, sched.run(x, labels=labels), ref_losses, atol, rtol)
        ctx.close(f"{name}.grads", grads_numpy(sched), trained(sched, full), atol, rtol)
        ctx.check(
            f"{name}.float32_accumulators", {str(g.dtype) for g in sched.grads().values()} == {"Float32"}
        )

    return Case(name, run)


def next_step_is_exact(ctx: Rank, sched, ref, name: str, micro: int, seed: int) -> dict:
    """After a skipped step: the next run's losses and gradients equal the reference's (whose
    gradients it returns)."""
    dp = ctx.mesh.dp_size
    x, labels = batch(2 * micro * dp, seed=seed)
    ref_losses, full = reference(ref, x, labels, dp * micro, scale=1 / (dp * micro))
    x_mine, labels_mine = share(ctx, x, labels)
    ctx.losses(f"{name}.next", sched.run(x_mine, labels=labels_mine), mine(ctx, ref_losses, micro))
    ctx.close(f"{name}.next.grads", grads_numpy(sched), trained(sched, full))
    return full


def overflow_case(name: str, **options) -> Case:
    """Stage 2 (pipeline rank 0) of replica 1 alone overflows: every rank of the mesh skips the
    same step (weights and Adam state unchanged), the scale halves everywhere; the next step
    is finite and equals the reference."""

    def run(ctx: Rank) -> None:
        gated = 2
        model, ref = build_gated(2 * ctx.pp, gated), build(2 * ctx.pp, "trainable")
        scaler = amp.DynamicLossScaler(2.0**10, 2, 1000)
        micro, dp = 4, ctx.mesh.dp_size
        sched = make(model, ctx, micro, scale_grads=True, loss_scaler=scaler, **options)
        optimizer = nn.Adam(sched.trainable_params(), learning_rate=0.1)
        before = {p.name: crc(p) for p in sched.trainable_params()}
        moments = [crc(m) for m in optimizer.moment1]
        overflowing = ctx.mesh.dp_rank == 1 and ctx.pp_rank == gated % ctx.pp
        model.stages[gated].overflow(overflowing)
        x_mine, labels_mine = share(ctx, *batch(2 * micro * dp, seed=70))
        sched.run(x_mine, labels=labels_mine)
        ctx.check(f"{name}.every_rank_sees_the_overflow", sched.grads_finite is False)
        outcome = sched.step(optimizer, max_norm=1.0)
        ctx.check(
            f"{name}.skipped",
            outcome == {"finite": False, "grad_norm": None, "loss_scale": 512.0},
            f"{outcome}",
        )
        ctx.check(f"{name}.weights_unchanged", {p.name: crc(p) for p in sched.trainable_params()} == before)
        ctx.check(f"{name}.optimizer_state_unchanged", [crc(m) for m in optimizer.moment1] == moments)
        model.stages[gated].overflow(False)
        next_step_is_exact(ctx, sched, ref, name, micro, seed=71)
        ctx.check(f"{name}.next.finite", sched.grads_finite is True)
        outcome = sched.step(optimizer)
        ctx.check(
            f"{name}.next.applied", outcome["finite"] is True and outcome["loss_scale"] == 512.0, f"{outcome}"
        )
        ctx.check(f"{name}.next.weights_moved", {p.name: crc(p) for p in sched.trainable_params()} != before)

    return Case(name, run)


def tied_drift_case(name: str) -> Case:
    """An optimizer that decays the head's copy but not the embedding's (per-group settings)
    moves the copies apart: the next run() fails on every rank naming the pair, from checksums
    that rode in the tied gradients' all-reduce (one all-reduce per step, as without them)."""

    def run(ctx: Rank) -> None:
        model, pair = build_tied(ctx.pp)
        sched = make(model, ctx, 4, tied_parameters=[pair])
        params = sched.trainable_params()
        groups = [
            {"params": [p for p in params if p.name == pair[0]], "weight_decay": 0.0},
            {"params": [p for p in params if p.name != pair[0]], "weight_decay": 0.1},
        ]
        optimizer = nn.SGD([g for g in groups if g["params"]], learning_rate=0.5)
        x, labels = tied_batch(8, seed=30)
        sched.run(x, labels=labels)
        before = sched.stats()["transport"].all_reduces
        sched.run(x, labels=labels)  # the copies are still equal: a normal step
        ctx.check(f"{name}.one_all_reduce_per_step", sched.stats()["transport"].all_reduces - before == 1)
        sched.step(optimizer)
        try:
            sched.run(x, labels=labels)
        except TiedCopiesDriftError as exc:
            ctx.check(f"{name}.raised", f"{pair[0]!r} and {pair[1]!r} no longer hold" in str(exc), str(exc))
            return
        ctx.check(f"{name}.raised", False, "no error")

    return Case(name, run)


def bad_tied_name(name: str) -> Case:
    """A tied name that no rank holds: construction passes on ranks that cannot know, the
    set-up handshake fails on every rank naming it, before any training message."""

    def run(ctx: Rank) -> None:
        model, pair = build_tied(ctx.pp)
        sched = make(model, ctx, 2, tied_parameters=[(pair[0], "s0.nowhere")])
        x, labels = tied_batch(4)
        try:
            sched.run(x, labels=labels)
        except ConfigurationMismatchError as exc:
            ctx.check(name, "'s0.nowhere'" in str(exc) and "on no pipeline rank" in str(exc), str(exc))
            return
        ctx.check(name, False, "no error")

    return Case(name, run)


def bad_token_loss(name: str) -> Case:
    """A scalar loss with loss_reduction="token": the last stage's rank raises the clear error
    at its first micro-batch, every other rank learns it from the abort notice (no hang)."""

    def run(ctx: Rank) -> None:
        model = build(ctx.pp, "none")
        sched = make(model, ctx, 2, loss_reduction="token")
        x, labels = batch(4)
        try:
            sched.run(x, labels=labels)
        except GraphExecError as exc:
            ctx.check(name, "(sum_of_token_losses, token_count)" in str(exc), str(exc))
            return
        ctx.check(name, False, "no error")

    return Case(name, run)


def gate_meetings(sched) -> int:
    """How many all-reduces the schedule's update verdicts ran on this rank."""
    return sched._setup.step_end.gate.meetings


def non_finite_case(name: str, **options) -> Case:
    """No loss scaler; stage 1 (pipeline rank 1) of the last replica alone makes its gradients
    infinite: every rank of the mesh skips the update (weights unchanged everywhere), warns
    once, reports ``finite: False``; with clipping the norm's own meeting carries the verdict,
    without it one small meeting does; ``error_if_nonfinite=True`` raises on every rank; the
    next finite step equals the reference."""

    def run(ctx: Rank) -> None:
        gated, micro, dp = 1, 4, ctx.mesh.dp_size
        model, ref = build_gated(2 * ctx.pp, gated), build(2 * ctx.pp, "trainable")
        sched = make(model, ctx, micro, scale_grads=True, **options)
        optimizer = nn.SGD(sched.trainable_params(), learning_rate=0.5)
        before = {p.name: crc(p) for p in sched.trainable_params()}
        model.stages[gated].overflow(ctx.mesh.dp_rank == dp - 1 and ctx.pp_rank == gated % ctx.pp)
        x_mine, labels_mine = share(ctx, *batch(2 * micro * dp, seed=90))
        for max_norm in (1.0, None):
            sched.run(x_mine, labels=labels_mine)
            meetings = gate_meetings(sched)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outcome = sched.step(optimizer, max_norm=max_norm)
            step = f"{name}.max_norm_{max_norm}"
            ctx.check(
                f"{step}.skipped_everywhere",
                outcome == {"finite": False, "grad_norm": None, "loss_scale": None},
                f"{outcome}",
            )
            warned = [w for w in caught if issubclass(w.category, NonFiniteGradientWarning)]
            ctx.check(f"{step}.warned_once", len(warned) == 1, f"{[str(w.message) for w in caught]}")
            ctx.check(
                f"{step}.weights_unchanged", {p.name: crc(p) for p in sched.trainable_params()} == before
            )
            want = (ctx.pp > 1) + (dp > 1)  # one meeting: pipeline, then the flags over the replicas
            ctx.check(
                f"{step}.one_meeting",
                gate_meetings(sched) - meetings == want,
                f"{meetings} -> {gate_meetings(sched)}",
            )
        sched.run(x_mine, labels=labels_mine)
        try:
            sched.step(optimizer, max_norm=1.0, error_if_nonfinite=True)
            ctx.check(f"{name}.error_if_nonfinite_raises_everywhere", False, "no error")
        except NonFiniteGradientError as exc:
            ctx.check(
                f"{name}.error_if_nonfinite_raises_everywhere", "gradient norm is" in str(exc), str(exc)
            )
        sched.zero_grad()
        model.stages[gated].overflow(False)
        full = next_step_is_exact(ctx, sched, ref, name, micro, seed=91)
        outcome = sched.step(optimizer, max_norm=1e6)
        ctx.check(
            f"{name}.next.applied",
            outcome["finite"] is True and math.isclose(outcome["grad_norm"], global_norm(full), rel_tol=1e-5),
            f"{outcome}",
        )
        ctx.check(f"{name}.next.weights_moved", {p.name: crc(p) for p in sched.trainable_params()} != before)

    return Case(name, run)


def bad_optimizer_on_one_rank(name: str, **options) -> Case:
    """The last pipeline rank's optimizer also holds stage 0's parameters, which it does not
    train: it raises its ValueError, every other rank a RemoteRankError naming it, nothing is
    applied anywhere; then a good optimizer steps on every rank (the schedule is still usable),
    and a second step with it needs no meeting with a loss scaler (the verdict came with run())."""

    def run(ctx: Rank) -> None:
        model = build(2 * ctx.pp, "trainable")
        sched = make(model, ctx, 4, scale_grads=True, loss_scaler=amp.StaticLossScaler(1), **options)
        good = nn.SGD(sched.trainable_params(), learning_rate=0.5)
        held = sched.trainable_params() + (model.stages[0].trainable_params() if ctx.last else [])
        optimizer = nn.SGD(held, learning_rate=0.5)
        bad_rank = (
            ctx.mesh.pp_size - 1 + ctx.mesh.dp_rank * ctx.mesh.pp_size if ctx.mesh.dp_size == 1 else None
        )
        x_mine, labels_mine = share(ctx, *batch(8 * ctx.mesh.dp_size, seed=92))
        sched.run(x_mine, labels=labels_mine)
        before = {p.name: crc(p) for p in sched.trainable_params()}
        try:
            sched.step(optimizer)
            ctx.check(f"{name}.raises_on_every_rank", False, "no error")
        except ValueError as exc:
            ctx.check(f"{name}.raises_on_every_rank", ctx.last and "does not train" in str(exc), str(exc))
        except RemoteRankError as exc:
            named = bad_rank is None or f"ranks [{bad_rank}] failed in step()" in str(exc)
            ctx.check(f"{name}.raises_on_every_rank", not ctx.last and named, str(exc))
        ctx.check(f"{name}.nothing_applied", {p.name: crc(p) for p in sched.trainable_params()} == before)
        outcome = sched.step(good)
        ctx.check(f"{name}.still_usable", outcome["finite"] is True, f"{outcome}")
        sched.run(x_mine, labels=labels_mine)
        meetings = gate_meetings(sched)
        sched.step(good)
        ctx.check(f"{name}.steady_step_meets_nobody", gate_meetings(sched) == meetings)

    return Case(name, run)


def clip_fails_on_one_rank(name: str) -> Case:
    """Rank 0's share of the norm raises (its kernel broken, simulated): it raises its own
    error, every other rank a RemoteRankError naming it, in the same meeting; nothing is
    scaled anywhere, and the next clip works on every rank."""

    def run(ctx: Rank) -> None:
        model, ref = build(2 * ctx.pp, "trainable"), build(2 * ctx.pp, "trainable")
        sched = make(model, ctx, 4, scale_grads=True)
        x, labels = batch(8, seed=94)
        sched.run(x, labels=labels)
        _, full = reference(ref, x, labels, 4, scale=1 / 4)
        executor = sched._setup.executor
        honest = executor.grad_norm_part

        def broken(names, norm_type):
            raise RuntimeError("this rank's norm kernel broke")

        if ctx.pp_rank == 0:
            executor.grad_norm_part = broken
        try:
            sched.clip_grad_norm(1e-3)
            ctx.check(f"{name}.raises_on_every_rank", False, "no error")
        except RuntimeError as exc:
            if isinstance(exc, RemoteRankError):
                ok = ctx.pp_rank != 0 and "ranks [0] failed in clip_grad_norm()" in str(exc)
            else:
                ok = ctx.pp_rank == 0 and "norm kernel broke" in str(exc)
            ctx.check(f"{name}.raises_on_every_rank", ok, f"{type(exc).__name__}: {exc}")
        executor.grad_norm_part = honest
        ctx.close(f"{name}.nothing_scaled", grads_numpy(sched), trained(sched, full))
        norm = sched.clip_grad_norm(math.inf)
        ctx.check(f"{name}.next_clip", math.isclose(norm, global_norm(full), rel_tol=1e-5), f"{norm}")

    return Case(name, run)


class FailingSGD(nn.SGD):
    """An SGD whose update raises on the ranks told so (after the mesh's verdict)."""

    def __init__(self, params, fail: bool) -> None:
        super().__init__(params, learning_rate=0.5)
        self.fail = fail

    def construct(self, gradients):
        if self.fail:
            raise RuntimeError("this rank's optimizer broke while applying the update")
        return super().construct(gradients)


def optimizer_fails_after_the_verdict(name: str) -> Case:
    """The last pipeline rank's optimizer raises while applying the update (nothing to agree
    on any more): that rank refuses further steps and tells its peers, whose next run() names
    its failure instead of timing out. Runs last: it ends the schedule."""

    def run(ctx: Rank) -> None:
        model = build(2 * ctx.pp, "none")
        sched = make(model, ctx, 4, scale_grads=True)
        optimizer = FailingSGD(sched.trainable_params(), fail=ctx.last)
        x, labels = batch(8, seed=93)
        sched.run(x, labels=labels)
        try:
            sched.step(optimizer)
            stepped = None
        except RuntimeError as exc:
            stepped = str(exc)
        if ctx.last:
            ctx.check(
                f"{name}.raised_here", stepped is not None and "broke while applying" in stepped, f"{stepped}"
            )
            try:
                sched.run(x, labels=labels)
                ctx.check(f"{name}.refuses_further_steps", False, "no error")
            except GraphExecError as exc:
                ctx.check(f"{name}.refuses_further_steps", "an earlier step failed" in str(exc), str(exc))
            return
        ctx.check(f"{name}.applied_here", stepped is None, f"{stepped}")
        try:
            sched.run(x, labels=labels)
            ctx.check(f"{name}.peers_hear_of_it", False, "no error")
        except GraphExecError as exc:
            text = f"{exc} {exc.__cause__}"
            ctx.check(f"{name}.peers_hear_of_it", "broke while applying" in text, text)

    return Case(name, run)


SUITES: dict[str, list[Case]] = {
    "p2": [
        clip_case("clip_v2_trainable_central_graph", vpp=2),
        clip_case("clip_v1_trainable_owner_pynative", backward="owner", mode="pynative"),
        clip_case("clip_v1_frozen_graph", preprocess="frozen"),
        clip_case("clip_baseline_v2_pynative", vpp=2, baseline=True, mode="pynative"),
        clip_case("clip_scaled_v2_graph", vpp=2, loss_scaler=amp.DynamicLossScaler(2.0**10, 2, 1000)),
        tied_case("tied_central_graph"),
        tied_case("tied_owner_pynative", backward="owner", mode="pynative"),
        token_case("token_pynative", mode="pynative"),
        evaluate_case("evaluate_v2_trainable_graph", vpp=2),
        evaluate_case("evaluate_baseline_pynative", baseline=True, mode="pynative"),
        accumulate_case("accumulate_owner_graph", backward="owner"),
        low_precision_case("float16_graph", ms.float16),
        low_precision_case("bfloat16_pynative", ms.bfloat16, mode="pynative"),
        bad_tied_name("bad.tied_name_nowhere"),
        bad_token_loss("bad.token_loss_returns_a_scalar"),
        tied_drift_case("tied_drift_graph"),
    ],
    "p4": [
        clip_case("clip_v2_trainable_owner_m8_graph", vpp=2, micro=8, backward="owner"),
        clip_case("clip_v1_frozen_pynative", preprocess="frozen", mode="pynative"),
        clip_case(
            "clip_scaled_owner_static_pynative",
            backward="owner",
            mode="pynative",
            loss_scaler=amp.StaticLossScaler(1000),
        ),
        tied_case("tied_rank0_rank3_owner_graph", backward="owner"),
        evaluate_case(
            "evaluate_v2_owner_min_pynative", vpp=2, backward="owner", run_ahead="min", mode="pynative"
        ),
        token_case("token_graph"),
        bad_token_loss("bad.token_loss_returns_a_scalar"),
    ],
    "mesh": [
        overflow_case("overflow_on_one_rank_graph"),
        clip_case("clip_mesh_pynative", vpp=2, mode="pynative"),
        clip_case("clip_scaled_mesh_graph", loss_scaler=amp.DynamicLossScaler(2.0**10, 2, 1000)),
        tied_case("tied_mesh_graph"),
        # ZeRO-1: each copy of the pair updated by its own replica's owner, still one weight
        tied_case("tied_mesh_zero_pynative", vpp=2, mode="pynative", optimizer_sharding=True),
        token_case("token_mesh_pynative", mode="pynative"),
        evaluate_case("evaluate_mesh_pynative", vpp=2, mode="pynative"),
    ],
    "gate": [
        non_finite_case("non_finite_graph"),
        non_finite_case("non_finite_owner_pynative", backward="owner", mode="pynative"),
        bad_optimizer_on_one_rank("bad_optimizer_graph"),
        clip_fails_on_one_rank("clip_fails_on_one_rank"),
        optimizer_fails_after_the_verdict("optimizer_fails_after_the_verdict"),
    ],
    "gate_mesh": [
        non_finite_case("non_finite_mesh_graph"),
        bad_optimizer_on_one_rank("bad_optimizer_mesh_pynative", mode="pynative"),
    ],
    # Run with GRAPH_EXEC_CPU_FAST_PATHS=0 (tests/multirank/test_device_path.py): the broadcast
    # writes a bfloat16 preprocess back with MindSpore ops, where CPU's Assign has no kernel.
    "device_low_precision": [
        low_precision_case("float16_graph", ms.float16),
        low_precision_case("bfloat16_pynative", ms.bfloat16, mode="pynative"),
    ],
}


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    suite = sys.argv[1]
    mesh = ge.DeviceMesh(dp=2, pp=2) if suite in ("mesh", "gate_mesh") else ge.DeviceMesh()
    ctx = Rank(Checker(get_rank()), mesh)
    print(f"SUITE {suite} cases: {' '.join(case.name for case in SUITES[suite])}", flush=True)
    return run_suite(SUITES[suite], lambda case: case.run(ctx), ctx.checker)


if __name__ == "__main__":
    sys.exit(main())
