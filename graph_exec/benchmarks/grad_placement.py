"""Would moving the owners' gradient ship-backs into the bodies shorten an owner-backward step?

The schedule contract puts owner backward's ``GRADsend m`` / ``GRADrecv+bwd m`` in a suffix
after the bodies (``docs/schedule.md``, "MPipe layering"). This script builds the alternative
an opt-in placement would offer, validates it and simulates both with the same costs:

*early*: for each micro-batch ``m`` rank 0 does not own (in ``B 0.m`` order), the owner's
``GRADrecv+bwd m`` moves right before its first receive from rank 0 of a message rank 0 sends
after ``B 0.m``, and rank 0's ``GRADsend m`` right before that send: the owner back-propagates
where it would otherwise wait for rank 0. A move whose plan does not validate (every
invariant, rendezvous replay included) is not made: ``m`` stays in the suffix.

The default costs are those measured by ``graph-exec bench vl_tower --size small --variants
trainable-full-owner-tape`` on this project's 2-core machine (ms): F 4.1, B 3.4, Pf 44.5, R
30.1 (the tape's bprop), BCAST 3.2, GRADreduce 7.1; R 10 and R 60 show a lighter and a
recomputing backward. Run ``python -m graph_exec.benchmarks.grad_placement``.
"""

from __future__ import annotations

from dataclasses import replace

from graph_exec.schedule import Plan, PlanConfig, ScheduleError, build_plan, codes, validate
from graph_exec.schedule.codes import is_recv, is_stage0_backward, micro_of
from graph_exec.schedule.routing import partner_code, peer
from graph_exec.simulate import OpCosts, SimResult, simulate

MEASURED = OpCosts(
    forward=4.1, backward=3.4, preprocess_forward=44.5, recompute=30.1, broadcast=3.2, allreduce=7.1
)
SHAPES = ((2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 1, 16), (8, 2, 16))


def early_plan(config: PlanConfig) -> tuple[Plan, int]:
    """The contract's plan of ``config`` with each ship-back moved from the suffix into the
    bodies where the result validates; also returns how many stayed in the suffix."""
    contract = build_plan(config)
    rows = [list(row) for row in contract.order_codes]
    left = 0
    for backward in [c for c in rows[0] if is_stage0_backward(c) and config.owner(micro_of(c)) != 0]:
        m, owner = micro_of(backward), config.owner(micro_of(backward))
        send, receive = codes.GRADSEND | m, codes.GRADRECV_BWD | m
        trial = [list(row) for row in rows]
        trial[0].remove(send)
        trial[owner].remove(receive)
        place = _early_places(config, trial, owner, trial[0].index(backward))
        if place is not None:
            trial[0].insert(place[0], send)
            trial[owner].insert(place[1], receive)
            try:
                validate(Plan(config, trial, contract.body_codes))
            except ScheduleError:
                pass
            else:
                rows = trial
                continue
        left += 1
    return Plan(config, rows, contract.body_codes), left


def _early_places(
    config: PlanConfig, rows: list[list[int]], owner: int, after: int
) -> tuple[int, int] | None:
    """(index on rank 0, index on the owner) of the owner's first receive from rank 0 whose send
    rank 0 runs after index ``after``; ``None`` if there is none."""
    on_zero = {code: index for index, code in enumerate(rows[0])}
    for index, code in enumerate(rows[owner]):
        if is_recv(code) and peer(config, code) == 0 and on_zero.get(partner_code(code), -1) > after:
            return on_zero[partner_code(code)], index
    return None


def tail_after_rank0_body(result: SimResult) -> float:
    """How long the step runs on after rank 0's last ``B 0.m`` / ``TBWD``: with owner backward,
    the owners' last ``GRADrecv+bwd`` and the ``GRADreduce``, which nothing overlaps."""
    ends = [
        end
        for code, _, end in result.steps[0]
        if is_stage0_backward(code) or codes.kind_base(code) == codes.TBWD
    ]
    return result.step_time - max(ends)


def main() -> None:
    print("simulated step time (ms), owner backward, run_ahead full: contract suffix vs early placement")
    print("tail: time after rank 0's last B 0.m / TBWD (the owners' last GRADrecv+bwd, then GRADreduce)")
    header = ("P", "V", "M", "R", "suffix", "tail", "early", "tail", "early/suffix", "left in suffix")
    widths = (3, 3, 4, 5, 9, 7, 9, 7, 14, 16)
    print("".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for pp, vpp, micro in SHAPES:
        config = PlanConfig(pp=pp, vpp=vpp, micro=micro, preprocess="trainable", backward="owner")
        plan, left = early_plan(config)
        for recompute in (10.0, MEASURED.recompute, 60.0):
            costs = replace(MEASURED, recompute=recompute)
            suffix, early = simulate(build_plan(config), costs), simulate(plan, costs)
            row = (
                pp,
                vpp,
                micro,
                f"{recompute:.0f}",
                f"{suffix.step_time:.1f}",
                f"{tail_after_rank0_body(suffix):.1f}",
                f"{early.step_time:.1f}",
                f"{tail_after_rank0_body(early):.1f}",
                f"{early.step_time / suffix.step_time:.3f}",
                left,
            )
            print("".join(f"{v:>{w}}" for v, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
