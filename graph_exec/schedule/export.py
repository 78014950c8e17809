"""Plans as text, JSON and CSV.

**Text** — exactly one line per rank, ``r<rank>: <tokens>``, so a printed plan can be
compared line by line with ``docs/schedule.md``, "Worked examples".
``with_idle=True`` shows the body's idle slots as ``·``.

**JSON** — the machine format (``write_json`` streams it compactly, ``to_json`` returns it)::

    {
      "schema": "graph-exec/plan", "version": 2,
      "config": {"pp": 2, "vpp": 1, "micro": 4, "preprocess": "trainable",
                 "num_preprocess_layers": 1, "run_ahead": "full", "backward": "central",
                 "input": "replicated", "body": "interleaved", "transpose": true},
      "num_stages": 2, "last_stage": 1, "nt": 2,
      "owners": [0, 1, 0, 1],                      # owners[m]: rank that owns micro m
      "ranks": [
        {"rank": 0,
         "tokens": ["BCAST", "TFWD0", ...],         # the executable order (no idle slots)
         "held": {"activations": 3, "receives": 3,  # the most items of each kind held at
                  "preprocess outputs": 2,          # once (schedule.memory.peak_counts)
                  "preprocess tapes": 0,
                  "output gradients": 0},           # kept from I to W (body "zb" only)
         "steps": [{"kind": "BCAST", "stage": null, "micro": null, "peer": null},
                   {"kind": "OUTrecv", "stage": null, "micro": 1, "peer": 1}, ...]},
        ...
      ]
    }

``kind`` is the token spelling of the step type (``F``, ``Fsend``, ``GRADrecv+bwd``…);
``stage`` is set for body steps, ``micro`` for every step except ``BCAST`` / ``GRADreduce``;
``peer`` is the other rank of a send or receive, ``null`` otherwise. Version 1 named
``config.run_ahead`` ``overflow`` (before the option's rename). ``steps`` is written only
when asked for (``steps=True``; ``graph-exec plan --format json --json-steps``): the tokens
carry the same information in a fifth of the space.

**CSV** — the body in torch.distributed.pipelining's action grammar, one row per rank, one
action per cell: ``<stage><action><micro>`` with ``F``, ``B`` (full backward), ``I`` and ``W``
(torch's ``BACKWARD_INPUT`` and ``BACKWARD_WEIGHT``: the split backward of ``body="zb"``), ``SEND_F``,
``RECV_F``, ``SEND_B``, ``RECV_B`` (``Fsend s.m`` → ``sSEND_Fm``, ``Frecv s.m`` →
``sRECV_Fm``, ``Brecv s.m`` → ``sRECV_Bm``). That grammar has no preprocess actions, so MPipe
steps are left out: the rows are exactly :attr:`Plan.body`, which lets torch's schedule
validators and simulators read our body orders.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import TextIO

from graph_exec.schedule import codes, routing
from graph_exec.schedule.memory import peak_counts
from graph_exec.schedule.plan import Plan
from graph_exec.schedule.steps import GLOBAL_KINDS, STAGED_KINDS, StepKind

_TORCH_ACTION = {
    StepKind.F: "F",
    StepKind.B: "B",
    StepKind.I: "I",
    StepKind.W: "W",
    StepKind.FSEND: "SEND_F",
    StepKind.FRECV: "RECV_F",
    StepKind.BSEND: "SEND_B",
    StepKind.BRECV: "RECV_B",
}


# Per kind index: its spelling and which fields its token shows (as codes.decode does, without
# making a Step per code: 1.6 million steps spell in well under a second this way).
_SPELLING = tuple((k.value, k in STAGED_KINDS, k not in GLOBAL_KINDS) for k in codes.KINDS)


def _tokens(row: Sequence[int]) -> list[str]:
    """``[codes.token(c) for c in row]``, fast."""
    out = []
    append, mask = out.append, codes.FIELD_MASK
    for code in row:
        name, staged, has_micro = _SPELLING[code >> codes.KIND_SHIFT]
        if staged:
            append(f"{name}{code >> codes.STAGE_SHIFT & mask}.{code & mask}")
        elif has_micro:
            append(f"{name}{code & mask}")
        else:
            append(name)
    return out


def to_text(plan: Plan, with_idle: bool = False) -> str:
    """One line per rank, ``r<rank>: <tokens>`` (idle slots as ``·`` only with ``with_idle``)."""
    rows = plan.with_idle_codes if with_idle else plan.order_codes
    return "\n".join(f"r{rank}: " + " ".join(map(codes.token, row)) for rank, row in enumerate(rows)) + "\n"


def to_json(plan: Plan, steps: bool = True) -> str:
    """The plan in the documented JSON schema (see the module docstring), as one string."""
    out = io.StringIO()
    write_json(plan, out, steps=steps)
    return out.getvalue()


def write_json(plan: Plan, out: TextIO, steps: bool = False) -> None:
    """Stream the plan to ``out`` as compact JSON, one rank at a time.

    Only one rank's tokens are ever held as text, so P=64, V=4, M=1024 (1.6 million steps)
    writes in seconds and in a few MB of memory beyond the plan itself; the per-step objects
    (``steps=True``) are four times the size and are written step by step.
    """
    cfg = plan.config
    header = {
        "schema": "graph-exec/plan",
        "version": 2,
        "config": {
            "pp": cfg.pp,
            "vpp": cfg.vpp,
            "micro": cfg.micro,
            "preprocess": cfg.preprocess,
            "num_preprocess_layers": cfg.num_preprocess_layers,
            "run_ahead": cfg.run_ahead,
            "backward": cfg.backward,
            "input": cfg.input,
            "body": cfg.body,
            "transpose": cfg.transpose,
        },
        "num_stages": cfg.num_stages,
        "last_stage": cfg.last_stage,
        "nt": cfg.nt,
        "owners": [cfg.owner(m) for m in range(cfg.micro)],
    }
    compact = {"separators": (",", ":"), "ensure_ascii": False}
    out.write(json.dumps(header, **compact)[:-1] + ',"ranks":[')
    for rank, row in enumerate(plan.order_codes):
        out.write(("," if rank else "") + f'{{"rank":{rank},"tokens":')
        out.write(json.dumps(_tokens(row), **compact))
        out.write(',"held":' + json.dumps(peak_counts(plan, rank), **compact))
        if steps:
            out.write(',"steps":[')
            for index, code in enumerate(row):
                step = codes.decode(code)
                entry = {"kind": step.kind.value, "stage": step.stage, "micro": step.micro}
                entry["peer"] = routing.peer(cfg, code)
                out.write(("," if index else "") + json.dumps(entry, **compact))
            out.write("]")
        out.write("}")
    out.write("]}\n")


def to_csv(plan: Plan) -> str:
    """The body orders in torch pipelining's one-row-per-rank action grammar."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in plan.body_codes:
        actions = []
        for code in row:
            step = codes.decode(code)
            actions.append(f"{step.stage}{_TORCH_ACTION[step.kind]}{step.micro}")
        writer.writerow(actions)
    return out.getvalue()
