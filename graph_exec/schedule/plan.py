"""The plan object and ``build_plan``, the one entry point that builds and validates.

A :class:`Plan` holds every rank's order as step codes (:mod:`codes`) and makes
:class:`Step` objects only on demand, one rank at a time: a runtime process needs its own
rank's order, not the 1.6 million steps of a 64-rank plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import cached_property

from graph_exec.schedule import body, codes, mpipe, p2p, routing
from graph_exec.schedule.config import PlanConfig
from graph_exec.schedule.size import check_plan_size
from graph_exec.schedule.steps import Step
from graph_exec.schedule.validate import validate

Orders = tuple[tuple[Step, ...], ...]


class Plan:
    """Per-rank orders of one configuration.

    Three views, each as :class:`Step` tuples and as step codes (``*_codes``, for tools that
    walk large plans: validator, simulator):

    - ``orders`` / ``order_codes``: what the runtime executes (no idle slots);
    - ``with_idle`` / ``with_idle_codes``: the same with the idle slots of the body's time grid,
      for display (``graph-exec plan --with-idle``);
    - ``body`` / ``body_codes``: the orders without any MPipe step.

    Normally made by :func:`build_plan`, which validates it; the constructor takes codes and
    does not validate (tools and tests that need a hand-made or broken plan use it, or
    :meth:`from_tokens`).
    """

    def __init__(
        self,
        config: PlanConfig,
        order_codes: Sequence[Sequence[int]],
        body_codes: Sequence[Sequence[int]],
        with_idle_codes: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.config = config
        self.order_codes: tuple[tuple[int, ...], ...] = tuple(map(tuple, order_codes))
        self.body_codes: tuple[tuple[int, ...], ...] = tuple(map(tuple, body_codes))
        self._with_idle_codes = None if with_idle_codes is None else tuple(map(tuple, with_idle_codes))
        self._orders: dict[int, tuple[Step, ...]] = {}

    @classmethod
    def from_tokens(cls, config: PlanConfig, rows: Sequence[Sequence[str]]) -> Plan:
        """A plan from hand-written tokens (``·`` allowed), not validated.

        Its ``body`` is the body ``config`` builds, so :func:`validate` compares the tokens
        against the real thing; use it to check an edited or imported plan.
        """
        if len(rows) != config.pp:
            raise ValueError(f"need one row per rank ({config.pp}), got {len(rows)}")
        with_idle = [[codes.encode_step(Step.parse(t)) for t in row] for row in rows]
        orders = [[code for code in row if code != codes.IDLE] for row in with_idle]
        return cls(config, orders, _body(config, keep_idle=False), with_idle)

    @property
    def with_idle_codes(self) -> tuple[tuple[int, ...], ...]:
        """The orders with idle slots, as codes (built on first use: only displays need them)."""
        if self._with_idle_codes is None:
            body_with_idle = _body(self.config, keep_idle=True)
            self._with_idle_codes = tuple(map(tuple, mpipe.layer(self.config, body_with_idle)))
        return self._with_idle_codes

    @property
    def picture_codes(self) -> tuple[tuple[int, ...], ...]:
        """Deprecated name of :attr:`with_idle_codes`."""
        warnings.warn(
            "Plan.picture_codes is deprecated, use Plan.with_idle_codes", DeprecationWarning, stacklevel=2
        )
        return self.with_idle_codes

    def order(self, rank: int) -> tuple[Step, ...]:
        """The steps ``rank`` executes, in order (made once, then cached)."""
        steps = self._orders.get(rank)
        if steps is None:
            steps = self._orders[rank] = tuple(map(codes.decode, self.order_codes[rank]))
        return steps

    @property
    def orders(self) -> Orders:
        """Every rank's executable order (idle slots dropped)."""
        return tuple(self.order(rank) for rank in range(self.config.pp))

    @cached_property
    def with_idle(self) -> Orders:
        """Every rank's order with the body's idle slots (``IDLE`` steps), for display."""
        return tuple(tuple(map(codes.decode, row)) for row in self.with_idle_codes)

    @cached_property
    def body(self) -> Orders:
        """Every rank's body order: the orders without MPipe steps."""
        return tuple(tuple(map(codes.decode, row)) for row in self.body_codes)

    @property
    def num_stages(self) -> int:
        """``P * V`` virtual stages."""
        return self.config.num_stages

    @property
    def last_stage(self) -> int:
        """The stage that computes the loss (``P * V - 1``)."""
        return self.config.last_stage

    def stage_rank(self, stage: int) -> int:
        """The rank that runs ``stage`` (``stage mod P``)."""
        return self.config.stage_rank(stage)

    def owner(self, micro: int) -> int:
        """The rank that runs the preprocess forward of ``micro``."""
        return self.config.owner(micro)

    def owned(self, rank: int) -> tuple[int, ...]:
        """The micro-batches ``rank`` owns."""
        return self.config.owned(rank)

    def peer(self, rank: int, step: Step) -> int | None:
        """The other rank of a send or receive that ``rank`` runs; ``None`` for other steps.

        Raises ``ValueError`` when the step cannot run on ``rank`` (a stage of another rank,
        an ``OUTrecv`` off rank 0, an index out of range): asking for the peer of a step one
        does not run is a bug in the caller.
        """
        cfg = self.config
        if (step.stage is not None and not 0 <= step.stage < cfg.num_stages) or (
            step.micro is not None and not 0 <= step.micro < cfg.micro
        ):
            raise ValueError(f"{step} is outside this plan ({cfg.num_stages} stages, {cfg.micro} micros)")
        code = codes.encode_step(step)
        home = routing.home(cfg, code)
        if home is not None and home != rank:
            raise ValueError(f"{step} runs on rank {home}, not on rank {rank}")
        return routing.peer(cfg, code)


def _body(config: PlanConfig, keep_idle: bool) -> list[list[int]]:
    """The body orders: compute slots plus P2P steps."""
    return p2p.insert_p2p(body.build_slots(config), config.pp, config.vpp, keep_idle)


def build_plan(config: PlanConfig) -> Plan:
    """Build the plan of ``config`` and validate it (raises a ``ScheduleError`` if broken).

    A configuration whose plan would be too large for this machine is refused first, by
    formula, with :class:`~graph_exec.schedule.size.PlanTooLargeError` (:mod:`.size`)."""
    check_plan_size(config)
    body_orders = [tuple(row) for row in _body(config, keep_idle=False)]
    plan = Plan(config, mpipe.layer(config, body_orders), body_orders)
    validate(plan)
    return plan
