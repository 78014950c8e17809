"""What one launch runs: a :class:`JobSpec` written by the parent, read by every worker.

The spec travels as a JSON file in the run directory (``job.json``) rather than on the command
line, so the parent and the workers agree on one document and msrun never has to quote it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from graph_exec.schedule import PlanConfig

JOB_FILE = "job.json"
#: Prefix of the progress lines every worker prints per finished step (one JSON object each);
#: the parent echoes the last-stage worker's (they carry the loss) while the job runs.
PROGRESS = "@@graph-exec "
#: Run fields a ``job.json`` written by an older version may carry under their old name: old -> new.
RENAMED = {"overflow": "run_ahead"}


@dataclass(frozen=True)
class RunSpec:
    """One training configuration: a schedule over the example model.

    ``baseline`` runs the fair baseline, :class:`ScheduleInterleaved1F1B` with the same
    preprocess run on rank 0 and nothing transposed; ``run_ahead`` and ``backward`` then do not
    apply.
    """

    name: str
    mode: str = "graph"
    baseline: bool = False
    trainable: bool = False
    run_ahead: str = "full"
    backward: str = "central"
    keep_preprocess_tape: bool = False  #: see ScheduleMPipeTranspose
    body: str = "interleaved"  #: the schedules' ``body`` ("zb": the split backward)
    recompute: bool = False  #: the schedules' ``recompute`` (keep only each stage's input)
    measure_tape: bool = False  #: the schedules' ``measure_tape`` (each stage's tape measured)
    #: Decoder layers per stage for the example's ``build(layers=...)`` (``None``: its default
    #: split); the rebalanced baseline of ``graph-exec bench qwen2vl --tower-ratio`` sets it.
    layers: tuple[int, ...] | None = None
    #: MPipe's ``tower_order``; ``"balanced"`` places by the example's ``tower_costs`` of each batch.
    tower_order: str = "arrival"
    #: ZeRO-1 (``--zero 1``): each replica keeps the Adam state of its share of the parameters.
    optimizer_sharding: bool = False
    #: The example's packed rows (``build(pack_balance=...)``: ``"tower"`` or ``"tokens"``;
    #: ``graph-exec bench qwen2vl --image-mix --packing``); ``None``: not packed.
    pack_balance: str | None = None

    @property
    def preprocess(self) -> str:
        """The plan's preprocess kind (the baseline runs the same preprocess, untransposed)."""
        return "trainable" if self.trainable else "frozen"


@dataclass(frozen=True)
class JobSpec:
    """Everything the workers of one launch need; ``runs`` are executed round-robin, step by step."""

    example: str
    size: str
    ranks: int  #: every rank of the job, on every node (dp x pp)
    vpp: int
    micro: int  #: micro-batches per step of one pipeline replica
    batch: int  #: samples per step over all replicas (each replica trains on batch / dp)
    steps: int  #: measured steps per run, after ``warmup``
    warmup: int  #: steps per run before the measured ones (compilation, allocator warm-up)
    runs: tuple[RunSpec, ...]
    lr: float = 1e-3
    timeout_s: float = 120.0  #: bound on every wait for a peer inside a step
    calibrate: bool = False  #: also measure transfer sizes and the executor's per-call dispatch cost
    pin_cores: bool = False  #: bind each rank to its share of the cores (see graph_exec.harness.worker)
    seed: int = 0
    #: Checkpoints (single-run jobs): the first step index (> 0: load that checkpoint first),
    #: save every ``save_every`` steps (0: never) and after the last step, into ``checkpoint_dir``.
    first_step: int = 0
    save_every: int = 0
    checkpoint_dir: str | None = None
    dp: int = 1  #: pipeline replicas (data parallel); each has ranks / dp pipeline ranks
    nodes: int = 1  #: hosts the job spans (ranks / nodes workers on each)
    verbose: bool = False  #: keep MindSpore's warnings in the worker logs
    device: str = "CPU"  #: MindSpore device target of every rank (each rank takes its local device)
    #: Extra keyword arguments of the example's ``build`` for every run (``vision_depth``).
    model_options: dict | None = None
    #: Sequence lengths drawn per step, uniformly in ``[min, max]`` (``None``: the example's own).
    seq_len_range: tuple[int, int] | None = None
    #: The schedules' ``shapes`` (``"static"``, ``"buckets"``, ``"dynamic"``), and the buckets.
    shapes: str = "static"
    shape_buckets: tuple[int, ...] | None = None
    #: After the last step, every rank exports the model here (``graph_exec.models.export_pretrained``).
    export_dir: str | None = None
    export_overwrite: bool = False
    #: The export's dtype (``float32``, ``bfloat16``, ``float16``; ``None``: the checkpoint's own).
    export_dtype: str | None = None
    #: Where the batches come from: ``"steps"`` (the example's batch of each step index) or
    #: ``"shuffled"`` (a fixed set of the example's samples read through
    #: :class:`graph_exec.data.DataLoader`, shuffled per epoch, its position checkpointed).
    data: str = "steps"

    @property
    def pp(self) -> int:
        """Ranks per pipeline replica."""
        return self.ranks // self.dp

    @property
    def mesh(self) -> str:
        return f"dp={self.dp} x pp={self.pp}"

    def plan_config(self, spec: RunSpec) -> PlanConfig:
        """The plan ``spec`` executes (what the schedule builds on every rank); raises
        :class:`~graph_exec.schedule.PlanConfigError` for an impossible combination."""
        return PlanConfig(
            pp=self.pp,
            vpp=self.vpp,
            micro=self.micro,
            preprocess=spec.preprocess,
            run_ahead=spec.run_ahead if not spec.baseline else "full",
            backward=spec.backward if not spec.baseline else "central",
            transpose=not spec.baseline,
            body=spec.body,
        )

    @property
    def total_steps(self) -> int:
        """Steps this launch runs (``first_step`` onwards)."""
        return self.warmup + self.steps

    @property
    def end_step(self) -> int:
        """The index after the last step of this launch (the training's total step count)."""
        return self.first_step + self.total_steps

    def write(self, run_dir: Path) -> Path:
        path = run_dir / JOB_FILE
        path.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: Path) -> JobSpec:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data["runs"] = tuple(_run_spec(run) for run in data["runs"])
        for name in ("seq_len_range", "shape_buckets"):
            data[name] = None if data.get(name) is None else tuple(data[name])
        return cls(**data)


def _run_spec(run: dict) -> RunSpec:
    """One run of a ``job.json``; a file written before a rename (a run to resume) names fields by
    :data:`RENAMED`'s old names."""
    fields = {RENAMED.get(name, name): value for name, value in run.items()}
    fields["layers"] = None if fields.get("layers") is None else tuple(fields["layers"])
    return RunSpec(**fields)
