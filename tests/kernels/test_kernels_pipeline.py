"""The hooks, driven by hand over a pipelined model, against a non-pipelined reference.

Tolerance everywhere: ``|actual - expected| <= 1e-5 + 1e-4 * |expected|`` (see tests.models.common).
The model is a preprocess with two outputs and three stages (tuple in, tuple out, loss), the
micro-batches run GPipe-style (all forwards, then all backwards in reverse) so several
forwards are kept at once, and the loss is scaled by 1/M as a runtime averaging would. Every
check runs in both modes, with the default taped forward and with ``recompute=True``.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from graph_exec.device import policy
from graph_exec.examples.lm import LMConfig, build_lm_stages, lm_cross_entropy
from graph_exec.executors import create_executor
from tests.models.common import assert_close, loss_fn, named
from tests.models.kernel import MODES, micro_batches, reference, snapshot

MICRO = 3
VARIANTS = [(mode, recompute) for mode in MODES for recompute in (False, True)]


def run_pipeline(
    mode: str, recompute: bool, preprocess: nn.Cell, stages: dict[int, nn.Cell], batches: list
) -> dict:
    """Losses, gradients and the kept-state trace of one pipelined step."""
    executor = create_executor(
        mode,
        stages,
        preprocess=preprocess,
        loss_fn=loss_fn,
        loss_scale=1.0 / len(batches),
        recompute=recompute,
    )
    executor.zero_grad()
    losses, stage0_inputs = [], []
    for micro, (x, labels) in enumerate(batches):
        hidden = executor.preprocess_forward((x,), {})
        stage0_inputs.append(hidden)
        mixed = executor.stage_forward(0, micro, hidden)
        combined = executor.stage_forward(1, micro, mixed)
        loss, (d_combined,) = executor.last_stage_step(2, micro, combined, (labels,))
        losses.append((loss.asnumpy(), d_combined))
    kept_after_forwards = sorted(executor.kept())
    for micro in reversed(range(len(batches))):
        x, _ = batches[micro]
        d_mixed = executor.stage_backward(1, micro, (losses[micro][1],))
        d_hidden = executor.stage_backward(0, micro, d_mixed)
        executor.preprocess_backward((x,), {}, d_hidden)
    return {
        "losses": [loss for loss, _ in losses],
        "grads": snapshot(executor.grads()),
        "kept_after_forwards": kept_after_forwards,
        "kept_at_end": list(executor.kept()),
        "stats": executor.compile_stats,
        "broadcast": [p.name for p in executor.broadcast_tensors()],
    }


@pytest.fixture(scope="module")
def results() -> dict:
    from tests.models import kernel as km

    ms.set_seed(3)
    preprocess = named(km.Projector(), "pre.")
    stages = {
        0: named(km.Mixer(), "s0."),
        1: named(km.Combiner(), "s1."),
        2: named(km.Classifier(), "s2."),
    }
    batches = micro_batches(MICRO)

    def whole_model(x: Tensor, labels: Tensor) -> Tensor:
        return loss_fn(stages[2](stages[1](*stages[0](*preprocess(x)))), labels)

    params = preprocess.trainable_params() + [p for k in sorted(stages) for p in stages[k].trainable_params()]
    ref_losses, ref_grads = reference(whole_model, params, batches)
    out = {variant: run_pipeline(*variant, preprocess, stages, batches) for variant in VARIANTS}
    out["reference"] = {"losses": ref_losses, "grads": {k: v / MICRO for k, v in ref_grads.items()}}
    out["preprocess_params"] = [p.name for p in preprocess.trainable_params()]
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_losses_match_reference(results: dict, variant: tuple) -> None:
    for micro, (got, want) in enumerate(
        zip(results[variant]["losses"], results["reference"]["losses"], strict=True)
    ):
        assert_close(got, want, f"{variant} loss of micro-batch {micro}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_body_and_preprocess_gradients_match_reference(results: dict, variant: tuple) -> None:
    got, want = results[variant]["grads"], results["reference"]["grads"]
    assert sorted(got) == sorted(want)
    assert any(name.startswith("pre.") for name in got)
    for name in want:
        assert np.abs(want[name]).max() > 0, (
            f"reference gradient of {name} is zero: the test would be vacuous"
        )
        assert_close(got[name], want[name], f"{variant} gradient of {name}")


@pytest.mark.parametrize("recompute", [False, True])
def test_graph_equals_pynative(results: dict, recompute: bool) -> None:
    graph, pynative = results[("graph", recompute)], results[("pynative", recompute)]
    for micro, (a, b) in enumerate(zip(graph["losses"], pynative["losses"], strict=True)):
        assert_close(a, b, f"loss of micro-batch {micro}, graph vs pynative")
    for name in graph["grads"]:
        assert_close(graph["grads"][name], pynative["grads"][name], f"gradient of {name}, graph vs pynative")


@pytest.mark.parametrize("variant", VARIANTS)
def test_forwards_are_kept_until_their_backward(results: dict, variant: tuple) -> None:
    expected = sorted((stage, micro) for stage in (0, 1) for micro in range(MICRO))
    assert results[variant]["kept_after_forwards"] == expected
    assert results[variant]["kept_at_end"] == []


def test_broadcast_tensors_are_the_trainable_preprocess_parameters(results: dict) -> None:
    for variant in VARIANTS:
        assert results[variant]["broadcast"] == results["preprocess_params"]


@pytest.mark.parametrize("recompute", [False, True])
def test_only_graph_mode_compiles(results: dict, recompute: bool) -> None:
    # preprocess forward and backward; for stages 0 and 1: forward and backward; the last stage:
    # its loss and gradient in one graph. One each, and zero_grad's where it is not a host memset.
    zeroing = 0 if policy().host_gradient_math else 1
    assert results[("graph", recompute)]["stats"].compilations == 7 + zeroing
    assert results[("graph", recompute)]["stats"].compile_seconds > 0
    assert results[("pynative", recompute)]["stats"].compilations == 0


@pytest.mark.parametrize(("mode", "recompute"), VARIANTS)
def test_embedding_lm_with_integer_token_ids(mode: str, recompute: bool) -> None:
    """Stage 0 embeds int32 token ids: its input gradient is None and the ids stay untouched."""
    ms.set_seed(11)
    config = LMConfig(vocab=16, width=8, heads=2, layers=2, seq=4)
    stages = dict(enumerate(build_lm_stages(config, 2, prefix=f"lm_{mode}{recompute}")))
    rng = np.random.default_rng(5)
    batches = [
        (
            Tensor(rng.integers(0, config.vocab, (2, config.seq), dtype=np.int32)),
            Tensor(rng.integers(0, config.vocab, (2, config.seq), dtype=np.int32)),
        )
        for _ in range(2)
    ]

    def whole_model(ids: Tensor, labels: Tensor) -> Tensor:
        return lm_cross_entropy(stages[1](stages[0](ids)), labels)

    params = stages[0].trainable_params() + stages[1].trainable_params()
    ref_losses, ref_grads = reference(whole_model, params, batches)

    executor = create_executor(mode, stages, loss_fn=lm_cross_entropy, recompute=recompute)
    for micro, (ids, labels) in enumerate(batches):
        before = ids.asnumpy().copy()
        hidden = executor.stage_forward(0, micro, (ids,))
        loss, (d_hidden,) = executor.last_stage_step(1, micro, hidden, (labels,))
        assert executor.stage_backward(0, micro, (d_hidden,)) == (None,)
        np.testing.assert_array_equal(ids.asnumpy(), before)
        assert_close(loss, ref_losses[micro], f"loss of micro-batch {micro}")
    grads = snapshot(executor.grads())
    assert sorted(grads) == sorted(ref_grads)
    for name, want in ref_grads.items():
        assert_close(grads[name], want, f"gradient of {name}")
