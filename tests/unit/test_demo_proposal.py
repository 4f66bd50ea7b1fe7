"""`make demo` takes its restart from the run's last live proposal (an ended run's proposal is unavailable, so the
demo restarted 'anyway' at max_depth whatever the live proposals said) and prints which evidence decided it."""

import importlib.util
import json
from pathlib import Path

import httpx

SPEC = importlib.util.spec_from_file_location("demo", Path(__file__).resolve().parents[2] / "examples" / "demo.py")
demo = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(demo)


def proposal(action: str, source: str, **fields: object) -> dict:
    return {"attempt": 1, "step": 120, "action": action, "summary": f"{action} ...", "reason": "why",
            "sim_acc": [0.9, 0.85, 0.84, 0.88], "sim_tau": [1.9, 2.6, 3.2, 3.8], "suggested_ttt": None,
            "depth_after": None, **fields,
            "evidence": {"source": source, "detail": f"{source}: where from", "acceptance": [0.95, 0.95, 0.948, 0.8],
                         "acceptance_interval": [[0.93, 0.97]] * 4 if source == "decoding" else []}}


def test_the_demo_restarts_as_the_last_live_proposal_says_and_prints_its_evidence(capsys) -> None:
    stream = "".join(f"event: {kind}\r\ndata: {json.dumps(data)}\r\n\r\n" for kind, data in (
        ("proposal", proposal("keep_going", "simulation")), ("status", {"status": "evaluating"}),
        ("proposal", proposal("restart", "decoding", suggested_ttt=5, depth_after=5,
                              restart={"overrides": {"ttt_steps": 5}, "clean": True})),
        ("status", {"status": "succeeded"})))
    runner = demo.Demo.__new__(demo.Demo)  # no .demo/ home, no server: only its API client
    runner.api = httpx.Client(base_url="http://demo", transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})))
    last = runner.last_proposal("r1")
    assert last["action"] == "restart" and last["evidence"]["source"] == "decoding"
    assert demo.restart_from(last) == {"overrides": {"ttt_steps": 5}, "clean": True}
    lines = demo.proposal_lines(last)
    assert "decided by decoding: 0.95 0.95 0.95 0.80 (90% interval [0.93, 0.97]" in lines
    assert "decoding: where from" in lines
    assert "restarts anyway" not in capsys.readouterr().out


def test_the_demo_prints_the_rule_the_interval_and_what_settles_a_cannot_tell(capsys) -> None:
    unsure = proposal("cannot_tell", "simulation")
    unsure["evidence"] |= {"rounds": [60, 54, 46, 39], "interval": "Wilson 90% over the rounds",
                           "decay_from": "sim_step_acc_k", "decay_note": "no survivor bias",
                           "gain_interval": [0.0, 0.196], "settle": "about 4x the 60 validation rounds"}
    lines = demo.proposal_lines(unsure)
    assert "decided by simulation: 0.95 0.95 0.95 0.80 over 60 rounds" in lines
    assert "the retrain rule read sim_step_acc_k: no survivor bias" in lines
    assert "the gain over those intervals: +0.0% to +19.6%" in lines
    assert "what settles it: about 4x the 60 validation rounds" in lines
    change = demo.restart_from(unsure)
    out = capsys.readouterr().out
    assert "the service says cannot tell yet: about 4x the 60 validation rounds" in out
    assert change == {"overrides": {"ttt_steps": demo.DEPLOY["max_depth"]}, "clean": True} and "restarts anyway" in out
