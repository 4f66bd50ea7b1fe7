"""`longrun advise RUN_ID` (the service's live proposal) and `longrun advise --evaluation` of the API's own
evaluation JSON, in this process against the in-process API (tests/longrun/conftest.py `cli`)."""

import json
from pathlib import Path

import pytest

from longrun.cli import main
from longrun.exit_codes import ExitCode
from server.lifecycle import RunStatus as S
from tests.inprocess import App
from tests.server.test_api_routes import EVALUATION, evaluated_run
from tests.server.test_interconnect_api import fake_host_env, probe, responder  # noqa: F401 - fixtures
from tests.server.test_proposal import SHALLOW, feed, trainer_run, validate
from worker.interconnect import InterconnectResponder

# what a restart proposal does once made: the retrain rule's record as one that held (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rule_trusted", "rule_unbounded")


@pytest.mark.usefixtures("fake_host_env")
def test_advise_run_id_prints_the_live_proposal_with_its_terms(cli: App, responder: InterconnectResponder,  # noqa: F811
                                                               capsys: pytest.CaptureFixture) -> None:
    probe(cli, responder, tp=2)
    run_id = trainer_run(cli, deploy={"host": "local", "engine": "sglang"})
    feed(cli, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(cli, run_id, 1, 100, SHALLOW)
    assert main(["advise", run_id, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["action"] == "restart" and answer["suggested_ttt"] > 3
    assert main(["advise", run_id]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"restart at TTT={answer['suggested_ttt']}: the dry run predicts")
    assert "GPU-hours (restart, extra)" in text and "on 2 GPUs" in text
    assert "the retrain rule's record: the retrain rule held within 10%" in " ".join(text.split())
    assert "nvlink, tp=2: sglang, chain, draft sharded at tp=2" in text and "draft AR" in text
    with pytest.raises(SystemExit) as missing:
        main(["advise", "nope0000"])
    assert missing.value.code == ExitCode.REFUSED and "no run with id" in capsys.readouterr().err


def test_advise_evaluation_reads_the_trained_depth_from_the_apis_evaluation_json(
        cli: App, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_id = evaluated_run(cli, EVALUATION, ttt_steps=5)
    path = tmp_path / "evaluation.json"
    path.write_text(cli.client.get(f"/v1/runs/{run_id}/evaluation").text)
    assert main(["advise", "--evaluation", str(path), "--interconnect", "pcie"]) == 0
    retrain = json.loads(capsys.readouterr().out)["retrain"]
    assert retrain["trained_ttt"] == 5 and "unknown" not in retrain["reason"]
    assert main(["advise", "--evaluation", str(path), "--interconnect", "pcie", "--trained-ttt", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["retrain"]["trained_ttt"] == 2


def test_advise_evaluation_with_an_engine_shows_each_depths_terms(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "evaluation.json"
    path.write_text(json.dumps({**EVALUATION, "ttt_steps": 1}))
    args = ["advise", "--evaluation", str(path), "--interconnect", "pcie", "--tp", "8"]
    assert main([*args, "--engine", "sglang"]) == 0
    sglang = json.loads(capsys.readouterr().out)
    assert sglang["drafting"]["sharded"] and sglang["by_depth"][0]["terms"]["draft_allreduces"] == 4
    # vLLM V0 honoured --draft-tp 1 (a replicated draft, no collectives of its own); V1, the default, shards it
    assert main([*args, "--engine", "vllm", "--draft-tp", "1", "--engine-version", "v0"]) == 0
    vllm = json.loads(capsys.readouterr().out)
    assert not vllm["drafting"]["sharded"] and vllm["by_depth"][0]["terms"]["draft_allreduces"] == 0
    assert main([*args, "--engine", "vllm", "--draft-tp", "1"]) == 0
    v1 = json.loads(capsys.readouterr().out)
    assert v1["drafting"]["sharded"] and v1["by_depth"][0]["terms"]["draft_allreduces"] == 4
    with pytest.raises(SystemExit):
        main(["advise", "--evaluation", str(path), "--engine", "sglang"])
    assert "pick --interconnect" in capsys.readouterr().err


def test_advise_on_an_ended_run_gives_the_advisors_full_answer_on_its_draft(cli: App,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """An ended run has no attempt to restart, so no live proposal: `advise` answers with the advisor on its evaluated
    draft (depth, tokens/s, the frontier of deeper TTTs, each depth's terms), not one line."""
    run_id = evaluated_run(cli, EVALUATION)
    cli.move(run_id, S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    assert main(["advise", run_id, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["action"] == "ended" and answer["advice"]["by_depth"], answer
    assert answer["summary"].startswith("the run has succeeded (attempt 1, TTT=1): no attempt to restart. Its draft "
                                        f"serves best at depth {answer['advice']['recommended_depth']}")
    assert main(["advise", run_id]) == 0
    text = capsys.readouterr().out
    assert text.startswith("the run has succeeded") and "tokens/s" in text
    assert len(text.splitlines()) > 5 and "mean_accepted" not in text, "the depths as a table"
    assert "nvlink, tp=8" in text
