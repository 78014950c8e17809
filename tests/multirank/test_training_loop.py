"""What a training loop needs, on real ranks under msrun: the global gradient norm and clipping,
loss scaling with one overflow verdict for the mesh, per-token loss, evaluation, tied
parameters and low-precision chunks, against the reference (what each check compares: the
worker, tests/multirank/workers/training_loop_checks.py). Three launches: P = 2, P = 4 and a
dp2 x pp2 mesh; two more for the update's verdict (non-finite gradients without a scaler, a
failure in ``step()`` on one rank): P = 2 and the mesh."""

import re

import pytest

from tests.multirank.conftest import checks

#: Checks every case of a suite must have passed on the ranks named (besides "no FAIL line").
EXPECTED = {
    "p2": {
        0: [
            "clip_v2_trainable_central_graph.norm_2.0",
            "clip_v2_trainable_central_graph.norm_inf_same_bits_everywhere",
            "clip_v1_trainable_owner_pynative.step1.grads",
            "clip_v1_frozen_graph.step1.grad_norm",
            "clip_v1_frozen_graph.clipped_grads",
            "clip_baseline_v2_pynative.step1.grads",
            "tied_central_graph.step1.tied_weights_stay_one",
            "tied_owner_pynative.step1.norm_counts_the_pair_once",
            "token_pynative.grads",
            "token_pynative.step1.norm_without_a_collective_of_its_own",
            "clip_scaled_v2_graph.step2.clip_needs_no_collective_of_its_own",
            "evaluate_v2_trainable_graph.grads_untouched",
            "accumulate_owner_graph.run1.accumulated",
            "float16_graph.grads",
            "bfloat16_pynative.grads",
            "bad.tied_name_nowhere",
            "bad.token_loss_returns_a_scalar",
            "tied_drift_graph.one_all_reduce_per_step",
            "tied_drift_graph.raised",
        ],
        1: [
            "tied_central_graph.step1.losses",
            "token_pynative.step1.losses",
            "token_pynative.step1.norm_without_a_collective_of_its_own",
            "clip_scaled_v2_graph.step2.grad_norm",
            "evaluate_v2_trainable_graph.eval.losses",
            "evaluate_v2_trainable_graph.outputs",
            "evaluate_baseline_pynative.outputs",
            "float16_graph.losses",
            "bfloat16_pynative.float32_accumulators",
            "bad.token_loss_returns_a_scalar",
            "tied_drift_graph.one_all_reduce_per_step",
            "tied_drift_graph.raised",
        ],
    },
    "p4": {
        0: [
            "clip_v2_trainable_owner_m8_graph.norm_2.0",
            "clip_v2_trainable_owner_m8_graph.clipped_grads",
            "tied_rank0_rank3_owner_graph.step1.grads",
            "clip_scaled_owner_static_pynative.step2.clip_needs_no_collective_of_its_own",
        ],
        2: ["clip_v1_frozen_pynative.step1.grads", "bad.token_loss_returns_a_scalar"],
        3: [
            "tied_rank0_rank3_owner_graph.step1.tied_weights_stay_one",
            "evaluate_v2_owner_min_pynative.outputs",
            "token_graph.step1.losses",
            "token_graph.step1.norm_without_a_collective_of_its_own",
        ],
    },
    "mesh": {
        rank: [
            "overflow_on_one_rank_graph.every_rank_sees_the_overflow",
            "overflow_on_one_rank_graph.skipped",
            "overflow_on_one_rank_graph.weights_unchanged",
            "overflow_on_one_rank_graph.next.grads",
            "clip_mesh_pynative.norm_2.0_same_bits_everywhere",
            "clip_mesh_pynative.clipped_grads",
            "tied_mesh_graph.step1.tied_weights_stay_one",
            "tied_mesh_zero_pynative.step1.tied_weights_stay_one",
            "tied_mesh_zero_pynative.step1.grads",
            "token_mesh_pynative.grads",
            "token_mesh_pynative.step1.norm_without_a_collective_of_its_own",
            "clip_scaled_mesh_graph.step2.clip_needs_no_collective_of_its_own",
            "evaluate_mesh_pynative.grads_untouched",
        ]
        for rank in range(4)
    },
    # Issue 39.2 and 39.5: one verdict for the mesh before the optimizer.
    "gate": {
        rank: [
            "non_finite_graph.max_norm_1.0.skipped_everywhere",
            "non_finite_graph.max_norm_1.0.warned_once",
            "non_finite_graph.max_norm_1.0.weights_unchanged",
            "non_finite_graph.max_norm_1.0.one_meeting",
            "non_finite_graph.max_norm_None.skipped_everywhere",
            "non_finite_graph.max_norm_None.one_meeting",
            "non_finite_graph.error_if_nonfinite_raises_everywhere",
            "non_finite_graph.next.grads",
            "non_finite_graph.next.applied",
            "non_finite_owner_pynative.max_norm_None.skipped_everywhere",
            "non_finite_owner_pynative.next.applied",
            "bad_optimizer_graph.raises_on_every_rank",
            "bad_optimizer_graph.nothing_applied",
            "bad_optimizer_graph.still_usable",
            "bad_optimizer_graph.steady_step_meets_nobody",
            "clip_fails_on_one_rank.raises_on_every_rank",
            "clip_fails_on_one_rank.nothing_scaled",
            "clip_fails_on_one_rank.next_clip",
        ]
        + (
            [
                "optimizer_fails_after_the_verdict.raised_here",
                "optimizer_fails_after_the_verdict.refuses_further_steps",
            ]
            if rank == 1
            else [
                "optimizer_fails_after_the_verdict.applied_here",
                "optimizer_fails_after_the_verdict.peers_hear_of_it",
            ]
        )
        for rank in range(2)
    },
    "gate_mesh": {
        rank: [
            "non_finite_mesh_graph.max_norm_1.0.skipped_everywhere",
            "non_finite_mesh_graph.max_norm_1.0.weights_unchanged",
            "non_finite_mesh_graph.max_norm_None.skipped_everywhere",
            "non_finite_mesh_graph.max_norm_None.one_meeting",
            "non_finite_mesh_graph.error_if_nonfinite_raises_everywhere",
            "non_finite_mesh_graph.next.grads",
            "bad_optimizer_mesh_pynative.raises_on_every_rank",
            "bad_optimizer_mesh_pynative.still_usable",
            "bad_optimizer_mesh_pynative.steady_step_meets_nobody",
        ]
        for rank in range(4)
    },
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("suite", "ranks"), [("p2", 2), ("p4", 4), ("mesh", 4), ("gate", 2), ("gate_mesh", 4)]
)
def test_training_loop_matches_the_reference(run_workers, suite, ranks):
    result = run_workers("training_loop_checks.py", ranks, suite, timeout_s=360)
    for rank in range(ranks):
        log = result.worker_logs[rank]
        assert "ALL DONE failures=0" in log, result.describe()
        cases = re.search(r"^SUITE \S+ cases: (.+)$", log, re.MULTILINE).group(1).split()
        passed = checks(result, rank)
        assert all(any(name.startswith(f"{case}.") or name == case for name in passed) for case in cases)
        missing = [name for name in EXPECTED[suite].get(rank, ()) if name not in passed]
        assert not missing, (missing, result.describe())
