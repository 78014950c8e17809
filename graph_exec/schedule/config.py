"""What a plan is built from, checked before anything is built.

Every rule that can reject a configuration lives here, so a bad value fails with one clear
message (naming the value and what is allowed) instead of an obscure error deep in a builder
or, worse, a hang at run time.
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass

from graph_exec import checks
from graph_exec.errors import GraphExecError

PREPROCESS = ("trainable", "frozen", "none")
RUN_AHEAD = ("full", "min")
BACKWARD = ("central", "owner")
INPUT = ("replicated", "owned")
BODY = ("interleaved", "1f1b", "gpipe", "zb")


#: Largest number of stages or micro-batches a plan can index (the step code fields are 28 bits).
INDEX_LIMIT = 1 << 28


class PlanConfigError(GraphExecError, ValueError):
    """A configuration that cannot be planned; the message names the value and what is allowed."""


@dataclass(frozen=True)
class PlanConfig:
    """One pipeline plan: ``P`` ranks, ``V`` chunks per rank, ``M`` micro-batches, MPipe options.

    Defaults describe a plain interleaved-1F1B body (no preprocess); ``micro`` defaults to
    ``pp`` (one round of micro-batches). Field names are the schedule layer's; their public-API
    counterparts are in ``docs/schedule.md``, "Notation and names". The MPipe options
    (``docs/schedule.md``, "MPipe layering"):

    - ``preprocess``: ``"trainable"`` (parameters broadcast every step, gradient via ``TBWD``),
      ``"frozen"`` (outputs only), ``"none"`` (dataload only: ``T = 0``, the preprocess is the
      identity; with replicated input the plan is exactly the body).
    - ``num_preprocess_layers`` (``T``): how many leading layers of stage 0 form the preprocess.
      ``"none"`` means ``T = 0`` and accepts only 0; ``"trainable"`` and ``"frozen"`` need
      ``T >= 1`` (a preprocess without layers is ``"none"``). ``None`` picks 0 or 1 accordingly.
      The plan's steps do not depend on the value beyond that; the runtime uses it to split
      the model.
    - ``run_ahead``: ``"full"`` (micro ``m`` owned by ``m mod NT``) or ``"min"`` (micros
      ``m >= NT`` stay on rank 0, run inline before ``F 0.m``).
    - ``backward``: ``"central"`` (rank 0 runs ``TBWD`` for every micro) or ``"owner"``
      (owners recompute and back-propagate, then ``GRADreduce``); owner needs a trainable
      preprocess, since otherwise there is no gradient to compute.
    - ``input``: ``"replicated"`` (every rank holds the batch) or ``"owned"`` (micro ``m``'s raw
      input lives on its owner, so central backward ships it to rank 0 with ``IN*``).
    - ``body``: ``"interleaved"`` (interleaved 1F1B, any ``V``), ``"1f1b"``
      (plain non-interleaved 1F1B, needs ``V = 1``) or ``"gpipe"`` (all forwards then all
      backwards; with ``V > 1`` it is looped breadth-first: chunk after chunk) or ``"zb"``
      (any ``V``: ZB-H1-style zero bubble, each backward split into ``I``, the input gradient,
      and ``W``, the weight gradients, placed in the bubbles; ``docs/schedule.md``, "Zero bubble").
    - ``transpose``: ``True`` (MPipe Transpose: owners run the preprocess of their micros in
      their warm-up, rank 0 receives the outputs). ``False`` is the *fair baseline*, MPipe
      without transposition: rank 0 runs ``TFWD m`` right before every ``F 0.m`` and, with a
      trainable preprocess, ``TBWD m`` right after every ``B 0.m``; no ``BCAST``, no transfers,
      the other ranks run exactly the body. Comparing the two isolates what transposition buys.
      It needs the defaults of the transposition options (``run_ahead="full"``,
      ``backward="central"``, ``input="replicated"``): none of them means anything without it.
    - ``forward_only``: ``True`` is the evaluation plan of the same configuration
      (``docs/schedule.md``, "Forward-only plans"): every stage's ``F`` of every micro, the
      forwards of each rank chunk by chunk (``body`` does not apply: there is no backward to
      interleave), with the same MPipe prefix (``BCAST``, the owners' ``TFWD`` and
      ``OUTsend``/``OUTrecv``, inline ``TFWD`` for ``run_ahead="min"`` or without transposition)
      and nothing of the backward: no ``B``, ``TBWD``, ``IN*``, ``GRAD*``.

    ``pp = 1`` has no peer rank, so nothing can be transposed: rank 0 owns every micro-batch
    and runs a trainable or frozen preprocess inline (``TFWD`` before the body's forwards,
    ``TBWD`` after ``B 0.m``), without ``BCAST`` since a group of one has nobody to send to.
    Options that only make sense with a peer are rejected: ``backward="owner"`` (no other
    owner to back-propagate on) and ``input="owned"`` (rank 0 necessarily holds every input).
    """

    pp: int
    vpp: int = 1
    micro: int | None = None
    preprocess: str = "none"
    num_preprocess_layers: int | None = None
    run_ahead: str = "full"
    backward: str = "central"
    input: str = "replicated"
    body: str = "interleaved"
    transpose: bool = True
    forward_only: bool = False
    #: The old name of ``run_ahead``, still taken from users' code with a ``DeprecationWarning``
    #: (not a field: the config holds ``run_ahead`` only).
    overflow: InitVar[str | None] = None

    def __post_init__(self, overflow: str | None) -> None:
        if overflow is not None:
            self._take_old_name(overflow)
        checks.positive_int("pp", self.pp, PlanConfigError)
        checks.positive_int("vpp", self.vpp, PlanConfigError)
        if self.micro is None:
            object.__setattr__(self, "micro", self.pp)
        checks.positive_int("micro", self.micro, PlanConfigError)
        if self.micro > INDEX_LIMIT or self.pp * self.vpp > INDEX_LIMIT:
            raise PlanConfigError(
                f"at most {INDEX_LIMIT} micro-batches and {INDEX_LIMIT} stages (pp*vpp), "
                f"got micro={self.micro}, pp*vpp={self.pp * self.vpp}"
            )
        checks.choice("preprocess", self.preprocess, PREPROCESS, PlanConfigError)
        checks.choice("run_ahead", self.run_ahead, RUN_AHEAD, PlanConfigError)
        checks.choice("backward", self.backward, BACKWARD, PlanConfigError)
        checks.choice("input", self.input, INPUT, PlanConfigError)
        checks.choice("body", self.body, BODY, PlanConfigError)
        self._check_layers()
        checks.boolean("transpose", self.transpose, PlanConfigError)
        checks.boolean("forward_only", self.forward_only, PlanConfigError)
        if not self.transpose:
            self._check_untransposed()
        if self.body == "1f1b" and self.vpp != 1:
            raise PlanConfigError(
                f"body '1f1b' is the non-interleaved schedule and needs vpp=1, got vpp={self.vpp}; "
                "use body 'interleaved' for vpp > 1"
            )
        if self.backward == "owner" and self.preprocess != "trainable":
            raise PlanConfigError(
                f"backward 'owner' needs preprocess 'trainable', got preprocess {self.preprocess!r}: "
                "a frozen or absent preprocess has no gradient to back-propagate"
            )
        if self.pp == 1:
            self._check_single_rank()

    def _take_old_name(self, overflow: str) -> None:
        """``PlanConfig(overflow=...)``: the value moves to ``run_ahead``; both, differing: an error."""
        if self.run_ahead not in ("full", overflow):
            raise PlanConfigError(
                f"run_ahead={self.run_ahead!r} and its old name overflow={overflow!r} disagree: pass run_ahead only"
            )
        warnings.warn("PlanConfig(overflow=...) is now run_ahead=...", DeprecationWarning, stacklevel=4)
        object.__setattr__(self, "run_ahead", overflow)

    def _check_layers(self) -> None:
        layers = self.num_preprocess_layers
        if layers is None:
            object.__setattr__(self, "num_preprocess_layers", 0 if self.preprocess == "none" else 1)
            return
        checks.non_negative_int("num_preprocess_layers", layers, PlanConfigError)
        if self.preprocess == "none" and layers != 0:
            raise PlanConfigError(
                f"preprocess 'none' is dataload only (T=0), got num_preprocess_layers={layers}; "
                "use preprocess 'trainable' or 'frozen' for T >= 1"
            )
        if self.preprocess != "none" and layers == 0:
            raise PlanConfigError(
                f"preprocess {self.preprocess!r} needs num_preprocess_layers >= 1, got 0; "
                "use preprocess 'none' for a dataload-only (T=0) plan"
            )

    def _check_untransposed(self) -> None:
        # Checked before the owner/trainable rule so the message names the real conflict.
        inline = "without transposition rank 0 runs every preprocess forward right before F 0.m"
        for name, value, default in (
            ("run_ahead", self.run_ahead, "full"),
            ("backward", self.backward, "central"),
            ("input", self.input, "replicated"),
        ):
            if value != default:
                raise PlanConfigError(
                    f"{name} {value!r} applies to transposed micro-batches, but transpose=False: "
                    f"{inline}; leave {name} at its default {default!r}"
                )

    def _check_single_rank(self) -> None:
        inline = (
            "with pp=1 rank 0 holds every micro-batch and runs the preprocess inline "
            "(TFWD before the body, TBWD after B 0.m)"
        )
        if self.backward == "owner":
            raise PlanConfigError(
                f"backward 'owner' needs a peer rank, but pp=1: {inline}; use backward 'central'"
            )
        if self.input == "owned":
            raise PlanConfigError(
                f"input 'owned' needs a peer rank, but pp=1: {inline}; use input 'replicated'"
            )

    # Geometry derived from the configuration, shared by builders, validator and simulator.

    @property
    def num_stages(self) -> int:
        """``P * V`` virtual stages."""
        return self.pp * self.vpp

    @property
    def last_stage(self) -> int:
        """The stage that computes the loss."""
        return self.pp * self.vpp - 1

    @property
    def nt(self) -> int:
        """``NT = min(P, M)``: how many ranks own micro-batches (1 without transposition)."""
        return min(self.pp, self.micro) if self.transpose else 1

    @property
    def mpipe(self) -> bool:
        """Whether any MPipe step is layered on the body (a preprocess, or inputs to ship)."""
        return self.preprocess != "none" or self.input == "owned"

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into ``I`` (input gradient) and ``W`` (weight gradients):
        the ``zb`` body of a training plan."""
        return self.body == "zb" and not self.forward_only

    @property
    def trainable(self) -> bool:
        """Whether the preprocess has parameters that need a gradient."""
        return self.preprocess == "trainable"

    @property
    def broadcasts(self) -> bool:
        """Whether every rank starts with ``BCAST`` (trainable weights, and somebody to send to)."""
        return self.trainable and self.num_preprocess_layers > 0 and self.pp > 1 and self.transpose

    @property
    def ships_inputs(self) -> bool:
        """Whether rank 0 needs ``IN*`` transfers to recompute micro-batches it does not hold."""
        return (
            self.trainable and self.backward == "central" and self.input == "owned" and not self.forward_only
        )

    def stage_rank(self, stage: int) -> int:
        """The rank that runs virtual stage ``stage``."""
        return stage % self.pp

    def owner(self, micro: int) -> int:
        """The rank that runs the preprocess forward of ``micro``."""
        if self.run_ahead == "full":
            return micro % self.nt
        return micro if micro < self.nt else 0

    def owned(self, rank: int) -> tuple[int, ...]:
        """The micro-batches ``rank`` owns, ascending."""
        if self.run_ahead == "full":
            return tuple(range(rank, self.micro, self.nt)) if rank < self.nt else ()
        if rank == 0:
            return (0, *range(self.nt, self.micro))
        return (rank,) if rank < self.nt else ()
