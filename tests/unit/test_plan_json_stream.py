"""The streamed, compact JSON plan export: tokens by default, step objects on request."""

from __future__ import annotations

import io
import json

import pytest

from graph_exec.cli import main
from graph_exec.schedule import PlanConfig, build_plan, to_json, write_json
from graph_exec.schedule.memory import peak_counts

CONFIG = PlanConfig(pp=4, vpp=2, micro=8, preprocess="trainable", backward="owner")


def test_tokens_only_by_default_and_compact():
    plan = build_plan(CONFIG)
    out = io.StringIO()
    write_json(plan, out)
    text = out.getvalue()
    assert "\n" not in text.rstrip("\n") and ", " not in text.split('"ranks"')[1]
    doc = json.loads(text)
    assert doc["schema"] == "graph-exec/plan" and doc["version"] == 2
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    for rank, entry in enumerate(doc["ranks"]):
        assert set(entry) == {"rank", "tokens", "held"}
        assert entry["tokens"] == [step.token for step in plan.orders[rank]]
        assert entry["held"] == peak_counts(plan, rank)


def test_steps_on_request_match_the_plan():
    plan = build_plan(CONFIG)
    doc = json.loads(to_json(plan, steps=True))
    for rank, entry in enumerate(doc["ranks"]):
        kinds = [(s["kind"], s["stage"], s["micro"]) for s in entry["steps"]]
        assert kinds == [(st.kind.value, st.stage, st.micro) for st in plan.orders[rank]]
        peers = [s["peer"] for s in entry["steps"]]
        assert peers == [plan.peer(rank, st) for st in plan.orders[rank]]


def test_cli_flag(capsys: pytest.CaptureFixture[str]):
    base = [
        "plan",
        "--pp",
        "2",
        "--vpp",
        "1",
        "--micro",
        "4",
        "--preprocess",
        "trainable",
        "--format",
        "json",
    ]
    assert main(base) == 0
    assert "steps" not in json.loads(capsys.readouterr().out)["ranks"][0]
    assert main([*base, "--json-steps"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ranks"][0]["steps"]) > 0
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--pp", "2", "--vpp", "1", "--micro", "4", "--preprocess", "none", "--json-steps"])
    assert exc.value.code == 2
    assert "--json-steps applies to --format json only" in capsys.readouterr().err
