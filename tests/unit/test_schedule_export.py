"""Text, JSON and CSV exports."""

from __future__ import annotations

import csv
import io
import json
import re

from graph_exec.schedule import PlanConfig, build_plan, to_csv, to_json, to_text

CONFIG = PlanConfig(pp=2, vpp=2, micro=4, preprocess="trainable", input="owned")


def test_text_is_one_line_per_rank() -> None:
    plan = build_plan(PlanConfig(pp=4, vpp=2, micro=8, preprocess="frozen"))
    lines = to_text(plan).splitlines()
    assert [line.split(": ")[0] for line in lines] == ["r0", "r1", "r2", "r3"]
    assert "·" not in to_text(plan)
    assert to_text(plan).endswith("\n")
    idle = to_text(plan, with_idle=True).splitlines()
    assert len(idle) == 4 and "·" in idle[1]
    assert [line.replace(" ·", "") for line in idle] == lines


def test_json_schema() -> None:
    plan = build_plan(CONFIG)
    doc = json.loads(to_json(plan))
    assert doc["schema"] == "graph-exec/plan" and doc["version"] == 2
    assert doc["config"] == {
        "pp": 2,
        "vpp": 2,
        "micro": 4,
        "preprocess": "trainable",
        "num_preprocess_layers": 1,
        "run_ahead": "full",
        "backward": "central",
        "input": "owned",
        "body": "interleaved",
        "transpose": True,
    }
    assert (doc["num_stages"], doc["last_stage"], doc["nt"], doc["owners"]) == (4, 3, 2, [0, 1, 0, 1])
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    for rank, entry in enumerate(doc["ranks"]):
        assert entry["tokens"] == [s.token for s in plan.orders[rank]]
        assert len(entry["steps"]) == len(entry["tokens"])
    steps0 = doc["ranks"][0]["steps"]
    assert steps0[0] == {"kind": "BCAST", "stage": None, "micro": None, "peer": None}
    assert {"kind": "INrecv", "stage": None, "micro": 3, "peer": 1} in steps0
    assert {"kind": "Fsend", "stage": 2, "micro": 0, "peer": 1} in steps0
    assert {"kind": "F", "stage": 0, "micro": 0, "peer": None} in steps0


# torch.distributed.pipelining's action grammar: [stage][action][micro]
_ACTION = re.compile(r"(\d+)(F|B|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)")
_TORCH_TO_OURS = {
    "F": "F",
    "B": "B",
    "SEND_F": "Fsend",
    "RECV_F": "Frecv",
    "SEND_B": "Bsend",
    "RECV_B": "Brecv",
}


def test_csv_is_the_body_in_torch_action_grammar() -> None:
    plan = build_plan(CONFIG)
    rows = list(csv.reader(io.StringIO(to_csv(plan))))
    assert len(rows) == 2
    assert rows[0][:6] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "2RECV_F0", "2F0"]
    for rank, row in enumerate(rows):
        ours = []
        for cell in row:
            stage, action, micro = _ACTION.fullmatch(cell).groups()
            ours.append(f"{_TORCH_TO_OURS[action]}{stage}.{micro}")
        assert ours == [s.token for s in plan.body[rank]]  # MPipe steps are left out
