"""`longrun advise RUN_ID` says the run's one verdict as the API does, with the evidence that decided: its rates and
their 90% intervals, the rounds behind them, the rate the retrain rule read, and for cannot_tell what settles it."""

import json

import pytest

from longrun.cli import main
from tests.inprocess import App
from tests.server.test_interconnect_api import fake_host_env, probe, responder  # noqa: F401 - fixtures
from tests.server.test_proposal import feed, trainer_run
from tests.server.test_proposal_evidence import FALLING, SIM, with_counts
from worker.interconnect import InterconnectResponder

pytestmark = pytest.mark.usefixtures("rule_unbounded")


@pytest.mark.usefixtures("fake_host_env")
def test_advise_prints_cannot_tell_with_its_interval_and_what_settles_it(
        cli: App, responder: InterconnectResponder, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    probe(cli, responder, tp=2)
    run_id = trainer_run(cli, deploy={"host": "local", "engine": "sglang"})
    feed(cli, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    feed(cli, run_id, 1, {"step": 100, "val_loss": 1.0, **with_counts(SIM, FALLING, 60)})
    api = cli.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert main(["advise", run_id, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["action"] == api["action"] == "cannot_tell" and answer["summary"] == api["summary"]
    assert main(["advise", run_id]) == 0
    text = capsys.readouterr().out.replace("\n", " ")
    assert text.startswith("cannot tell yet:")
    assert "decided by: simulation:" in text and "retrain rule reads: sim_step_acc_k" in text
    low, high = answer["evidence"]["step_acceptance_interval"][3]
    assert f"0.500 [{low:.3f}, {high:.3f}]" in text, "each rate with its interval"
    assert "rounds behind them: 60 54" in text
    assert "to settle it: the verdict at the measured rates (restart) holds once" in text


@pytest.mark.usefixtures("fake_host_env")
def test_advise_probe_takes_the_probe_the_proposal_offers(
        cli: App, responder: InterconnectResponder, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture) -> None:
    from server.advisor import rule_record
    from tests.server.test_proposal import SHALLOW, validate

    monkeypatch.setattr(rule_record, "MEASURED", tuple(
        rule_record.Checked("tiny", "regenerated", "nvlink", 3, to, 0.2, 0.16, 0.25) for to in range(4, 8)))
    probe(cli, responder, tp=2)
    run_id = trainer_run(cli, deploy={"host": "local", "engine": "sglang"})
    feed(cli, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(cli, run_id, 1, 100, SHALLOW)
    assert main(["advise", run_id]) == 0
    text = capsys.readouterr().out.replace("\n", " ")
    assert text.startswith("probe TTT=") and "probe (offered):" in text and "on_proposal: off:" in text
    assert main(["advise", run_id, "--probe", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["probe"]["status"] == "running" and answer["attempt"] == 2
    assert cli.client.get(f"/v1/runs/{run_id}").json()["attempts"][-1]["spec"]["trainer"]["max_steps"] == 200


def test_one_verdict_is_the_line_a_demo_prints_with_the_gap_its_evidence_measured() -> None:
    from longrun.commands.advise import one_verdict

    probe_answer = {"action": "probe", "summary": "probe TTT=5: resume the checkpoint ...: the advisor predicts ...",
                    "next_step": "probe TTT=5: resume the checkpoint at step 0 for 200 steps",
                    "evidence": {"calibration": [0.9, 0.5, 0.33]}}
    line = one_verdict(probe_answer)
    assert line.startswith("probe TTT=5 (next: probe TTT=5: resume the checkpoint at step 0 for 200 steps)")
    assert "measured decoding / simulation 0.33-0.90 by position (the simulation 3.0x decoding at worst)" in line
    assert one_verdict({"action": "keep_going", "summary": "keep going: the advisor predicts 50 tokens/s"}) == \
        "keep going"
