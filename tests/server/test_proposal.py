"""The depth proposal, in-process: a trainer run deployed on `local`, whose all-reduce table the worker's
InterconnectResponder measured through hostside (tests/fakegpu's captured H200 sweep); metric lines go through the
worker's ingest (worker/ingest.py) as the trainer writes them, sim_acc_k after each validation."""

import json
from pathlib import Path

import pytest

from server.advisor import rule_record
from server.config import Settings
from server.lifecycle import RunStatus
from server.models import Run
from tests.inprocess import App
from tests.server.test_interconnect_api import fake_host_env, probe, responder  # noqa: F401 - fixtures
from tests.worker.test_notifier import wait_for
from tests.worker.webhook_receiver import Receiver
from worker.ingest import store_metric_records
from worker.interconnect import InterconnectResponder
from worker.notifier import WebhookNotifier

# what a restart proposal does once made: the retrain rule's record as one that held (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rule_trusted")

# a TTT=3 draft: good inside its trained depth, poor beyond (the positions 4..16 it never learned)
SHALLOW = [0.8, 0.75, 0.7] + [0.3] * 13
# a draft whose acceptance beyond depth 3 already follows the decay inside it: nothing to gain by training deeper
STEADY = [0.8, 0.3, 0.1] + [0.05] * 13


def trainer_run(api: App, trainer_output_dir: str | None = None, **spec: object) -> str:
    out = trainer_output_dir or str(api.workspace / "out")
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": out,
               "ttt_steps": 3}
    r = api.client.post("/v1/runs", json={"name": "eagle3", "host": "local", "nproc_per_node": 2,
                                          "trainer": trainer, **spec}, params={"name_suffix": "true"})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    api.move(run_id, RunStatus.LAUNCHING, RunStatus.RUNNING)
    return run_id


def feed(api: App, run_id: str, line: int, record: dict, step_seconds: float | None = None) -> None:
    with api.session() as s:
        run = s.get(Run, run_id)
        store_metric_records(s, run, run.current, [(line, record, step_seconds)])


def validate(api: App, run_id: str, line: int, step: int, accs: list[float]) -> None:
    feed(api, run_id, line, {"step": step, "val_loss": 1.0, **{f"sim_acc_{k}": a for k, a in enumerate(accs, 1)}})


def events(api: App, run_id: str) -> list[tuple[str, dict]]:
    api.move(run_id, RunStatus.CANCELLING, RunStatus.CANCELLED)  # the stream ends at a terminal state
    text = api.client.get(f"/v1/runs/{run_id}/events").text.replace("\r\n", "\n")
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


@pytest.mark.usefixtures("fake_host_env")
def test_a_validation_with_sim_acceptance_gives_a_restart_proposal_priced_on_the_deploy_host(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
    url = f"/v1/runs/{run_id}/proposal"
    assert api.client.get(url).json()["action"] == "unavailable"
    assert "no sim_acc_k metrics" in api.client.get(url).json()["reason"]

    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    got = api.client.get(url).json()
    assert got["action"] == "restart", got["summary"]
    ttt = got["suggested_ttt"]
    assert ttt > 3 and got["trained_ttt"] == 3 and got["step"] == 100
    assert got["restart"] == {"overrides": {"ttt_steps": ttt}, "clean": True}
    assert got["summary"].startswith(f"restart at TTT={ttt}: the dry run predicts")
    # one break-even on every surface: the summary's, the reason's and the field's are one figure
    assert f"won back after {got['break_even_tokens']:.3g} tokens served" in got["summary"]
    assert f"won back after {got['break_even_tokens']:.3g} tokens served" in got["reason"]
    # the dry run is the restart's own: POST .../restart?dry_run=true with the proposed body says the same
    dry = api.client.post(f"/v1/runs/{run_id}/restart", params={"dry_run": True}, json=got["restart"]).json()
    assert got["predicted_training_seconds"] == pytest.approx(dry["predicted_duration_seconds"])
    # the economics: 2 GPUs train; the restart's GPU-hours and the extra over finishing this attempt
    assert got["gpus"] == 2
    assert got["restart_gpu_hours"] == pytest.approx(got["predicted_training_seconds"] * 2 / 3600)
    extra = got["predicted_training_seconds"] - got["remaining_seconds"]
    assert got["extra_gpu_hours"] == pytest.approx(extra * 2 / 3600)
    gain_per_token = 2 * (1 / got["tokens_per_second_now"] - 1 / got["tokens_per_second_after"])
    assert got["break_even_tokens"] == pytest.approx(extra * 2 / gain_per_token)
    assert got["tokens_per_second_after"] > got["tokens_per_second_now"] and got["depth_after"] == ttt
    # the advice behind it is on the measured table, with every depth's terms
    advice = got["advice"]
    assert advice["allreduce_basis"].startswith("measured on local by probe-interconnect")
    assert advice["drafting"]["engine"] == "sglang" and advice["drafting"]["sharded"]
    assert all(row["terms"]["draft_allreduces"] == 4 * row["depth"] for row in advice["by_depth"])
    assert got["predicted_tau_after"] == pytest.approx(1 + sum(got["predicted_position_acceptance_after"][:ttt]))

    feed(api, run_id, 2, {"step": 150, "total_steps": 1000, "loss": 1.9}, step_seconds=3.0)
    assert api.client.get(url).json()["step"] == 100, "the step of the validation it rests on"
    # the same validation again changes nothing: one proposal event, on the stream with its figures
    validate(api, run_id, 3, 200, SHALLOW)
    assert api.client.get(url).json()["step"] == 200
    stream = events(api, run_id)
    proposals = [data for kind, data in stream if kind == "proposal"]
    assert len(proposals) == 1 and proposals[0]["suggested_ttt"] == ttt and proposals[0]["action"] == "restart"
    assert proposals[0]["summary"] == got["summary"]


@pytest.mark.usefixtures("fake_host_env")
def test_keep_going_when_deeper_training_would_not_pay_and_an_unprobed_deploy_host_refused_at_submit(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    body = {"name": "eagle3", "host": "local", "trainer": {"verifier_path": "/m/v", "data_dir": "/d",
            "vocab_mapping_dir": "/v", "output_dir": str(api.workspace / "out")}}
    unmeasured = api.client.post("/v1/runs", json={**body, "deploy": {"host": "local", "engine": "vllm"}})
    assert unmeasured.status_code == 422, "an unprobed deploy host is refused at submit, not at the first validation"
    (error,) = unmeasured.json()["detail"]
    assert error["loc"] == ["body", "deploy", "host"] and "longrun hosts probe-interconnect local" in error["msg"]

    probe(api, responder, tp=2)
    elsewhere = api.client.post("/v1/runs", json={**body, "deploy": {"host": "local", "tp": 8}})
    assert elsewhere.status_code == 422 and elsewhere.json()["detail"][0]["loc"] == ["body", "deploy", "tp"]
    assert "measured at tp=2, not 8" in elsewhere.json()["detail"][0]["msg"]
    run_id = trainer_run(api, deploy={"host": "local", "engine": "vllm", "draft_tp": 1})
    feed(api, run_id, 0, {"step": 10, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 10, STEADY)
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert got["action"] == "keep_going" and got["restart"] is None
    # what a deeper TTT would reach is still said: the reason it does not pay
    assert got["predicted_tau_after"] == pytest.approx(
        1 + sum(got["predicted_position_acceptance_after"][:got["depth_after"]]))
    assert got["summary"].startswith("keep going: the advisor predicts")
    # vLLM V1 (no engine_version) shards the draft at tp=2 whatever draft_tp says, and cites the code
    assert got["advice"]["drafting"]["sharded"] and "#17499" in got["advice"]["drafting"]["placement"]
    assert "vllm/v1/spec_decode/eagle.py" in got["terms_basis"]["draft_placement"]
    no_deploy = trainer_run(api)
    assert "no `deploy" in api.client.get(f"/v1/runs/{no_deploy}/proposal").json()["reason"]
    bad = api.client.post("/v1/runs", json={"name": "x", "host": "local", "entrypoint": "/t.py",
                                            "deploy": {"host": "local", "engine": "sglang", "draft_tp": 1}})
    assert bad.status_code == 422 and "draft_tp" in bad.text


@pytest.mark.usefixtures("fake_host_env")
def test_on_proposal_restart_takes_the_proposal_once_per_run(api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    # the restart (6000 s) against the 2700 s this attempt has left: 2.2x, past the default factor of 2
    bounded = trainer_run(api, deploy={"host": "local"}, on_proposal="restart")
    feed(api, bounded, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, bounded, 1, 100, SHALLOW)
    assert api.client.get(f"/v1/runs/{bounded}").json()["status"] == "running"
    refused = api.client.get(f"/v1/runs/{bounded}/proposal").json()
    assert refused["action"] == "restart" and refused["auto_restart"].startswith("refused: it would take 1.67 h")
    assert "past auto_restart_max_factor 2" in refused["auto_restart"]
    off = trainer_run(api, deploy={"host": "local"})
    assert api.client.get(f"/v1/runs/{off}/proposal").json()["auto_restart"].startswith("off:")

    run_id = trainer_run(api, deploy={"host": "local"}, on_proposal="restart", auto_restart_max_factor=3)
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    run = api.client.get(f"/v1/runs/{run_id}").json()
    ttt = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert run["status"] == "restarting" and run["attempt"] == 2
    second = run["attempts"][-1]["spec"]["trainer"]["ttt_steps"]
    assert second > 3 and "taken by on_proposal: restart" in ttt["auto_restart"]

    # the new attempt runs and validates with a proposal that would restart again: it only proposes
    api.move(run_id, RunStatus.LAUNCHING, RunStatus.RUNNING)
    feed(api, run_id, 0, {"step": 50, "total_steps": 1000, "loss": 2.0}, step_seconds=4.0)
    validate(api, run_id, 1, 50, [0.8, 0.75, 0.7] + [0.1] * 13)
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "running" and run["attempt"] == 2
    assert api.client.get(f"/v1/runs/{run_id}/proposal").json()["attempt"] == 2


@pytest.mark.usefixtures("fake_host_env")
def test_without_on_proposal_a_restart_proposal_never_restarts(api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local"})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    assert api.client.get(f"/v1/runs/{run_id}/proposal").json()["action"] == "restart"
    assert api.client.get(f"/v1/runs/{run_id}").json()["status"] == "running"




@pytest.mark.usefixtures("fake_host_env")
def test_a_changed_proposal_goes_to_the_webhook(api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    receiver = Receiver()
    notifier = WebhookNotifier(api.db, Settings(home=api.settings.home, webhook_url=receiver.url))
    try:
        run_id = trainer_run(api, deploy={"host": "local"})
        feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
        validate(api, run_id, 1, 100, SHALLOW)
        validate(api, run_id, 2, 200, SHALLOW)
        validate(api, run_id, 3, 300, STEADY)
        queued = [n for n in notifier.run_once() if n.event == "proposal"]
        assert [n.message.split(":")[0] for n in queued] == ["restart at TTT=7", "keep going"]
        wait_for("two proposal calls", lambda: len(receiver.delivered()) == 2, timeout=20)
        assert [b["event"] for b in receiver.delivered()] == ["proposal", "proposal"]
        assert receiver.delivered()[0]["message"].startswith("restart at TTT=7: the dry run predicts")
    finally:
        notifier.close()
        receiver.close()


@pytest.mark.usefixtures("fake_host_env")
def test_a_deployment_that_speculates_at_most_five_deep_gets_at_most_ttt_5(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "max_depth": 5})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert got["action"] == "restart" and got["suggested_ttt"] == 5 and len(got["sim_acc"]) == 5
    assert [row["depth"] for row in got["advice"]["by_depth"]] == [1, 2, 3, 4, 5]


# the demo's TTT=3 draft at its last validation: positions 4-5 accepted above the decay inside its trained depth
DEMO_TTT3 = [0.80, 0.82, 0.87, 0.88, 0.87]
PCIE_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "pcie-model" / "allreduce-pcie-tp8.json"


@pytest.mark.usefixtures("fake_host_env")
def test_on_the_modelled_pcie_box_a_shallow_draft_gets_a_restart_and_the_demos_draft_keeps_going_saying_why(
        api: App, responder: InterconnectResponder, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # make demo's deployment box: the advisor's PCIe model at tp=8 as a probe answer, without GPU peer links
    monkeypatch.setenv("FAKE_ALLREDUCE_TABLE", str(PCIE_MODEL))
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    box = probe(api, responder, tp=8)
    assert box["tp"] == 8 and box["interconnect"] == "pcie" and box["gpus"] == ["NVIDIA H200 (PCIe model)"] * 8
    assert box["allreduce"] == json.loads(PCIE_MODEL.read_text())["allreduce"]
    deploy = {"host": "local", "tp": 8, "engine": "sglang", "max_depth": 5}
    shallow = trainer_run(api, deploy=deploy)
    feed(api, shallow, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, shallow, 1, 100, SHALLOW)
    got = api.client.get(f"/v1/runs/{shallow}/proposal").json()
    assert got["action"] == "restart" and got["restart"] == {"overrides": {"ttt_steps": 5}, "clean": True}
    assert "(pcie, tp=8, sglang)" in got["summary"]

    steady = trainer_run(api, deploy=deploy)
    feed(api, steady, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, steady, 1, 100, DEMO_TTT3)
    got = api.client.get(f"/v1/runs/{steady}/proposal").json()
    assert got["action"] == "keep_going" and got["depth_now"] == 5 and got["gain"] == 0.0
    # why, in figures a user can check: conditional 0.88, 0.87 beyond TTT=3 against sqrt(0.82 x 0.87) inside it
    assert "gain nothing" in got["reason"] and "accepts 0.88 0.87 at positions 4..5" in got["reason"]
    assert f"above the {(0.82 * 0.87) ** 0.5:.3f} per position" in got["reason"]
    assert got["predicted_tau_after"] == pytest.approx(1 + sum(got["predicted_position_acceptance_after"]))


@pytest.mark.usefixtures("fake_host_env")
def test_an_automatic_restart_never_overrides_a_restart_made_by_hand_since_the_proposal(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local"})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    assert api.client.get(f"/v1/runs/{run_id}/proposal").json()["action"] == "restart"
    # the user restarts by hand at a TTT of their own, and asks for automatic restarts from now on
    r = api.client.post(f"/v1/runs/{run_id}/restart", json={"overrides": {"ttt_steps": 5, "on_proposal": "restart"},
                                                             "clean": True})
    assert r.status_code == 202, r.text
    api.move(run_id, RunStatus.LAUNCHING, RunStatus.RUNNING)
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, [0.9] * 5 + [0.3] * 11)
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "running" and run["attempt"] == 2
    assert run["attempts"][-1]["spec"]["trainer"]["ttt_steps"] == 5
    stream = [data for kind, data in events(api, run_id) if kind == "proposal"]
    assert stream[-1]["action"] == "restart" and "restarted by hand" in stream[-1]["auto_restart"]
    assert not any(data.get("restarted_to_attempt") for data in stream)


@pytest.mark.usefixtures("fake_host_env")
def test_an_automatic_restart_whose_clean_would_fail_leaves_the_attempt_running_and_says_why(
        api: App, responder: InterconnectResponder, tmp_path: Path) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    outside = str(tmp_path / "elsewhere" / "out")  # not inside local's workspace: the clean is refused
    run_id = trainer_run(api, trainer_output_dir=outside, deploy={"host": "local"}, on_proposal="restart")
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "running" and run["attempt"] == 1
    stream = [data for kind, data in events(api, run_id) if kind == "proposal"]
    assert len(stream) == 1 and stream[0]["action"] == "restart"
    assert "would not succeed" in stream[0]["auto_restart"] and "outside the workspace" in stream[0]["auto_restart"]


@pytest.mark.usefixtures("fake_host_env")
def test_proposals_are_for_live_runs_with_a_deploy_and_take_names_and_prefixes(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    plain = trainer_run(api, name="no-deploy")
    feed(api, plain, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, plain, 1, 100, SHALLOW)
    assert not [kind for kind, _ in events(api, plain) if kind == "proposal"], "no 'no proposal yet' event"

    run_id = trainer_run(api, name="deployed", deploy={"host": "local"})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    by_id = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert by_id["action"] == "restart"
    for ref in ("deployed", run_id[:8]):
        got = api.client.get(f"/v1/runs/{ref}/proposal")
        assert got.status_code == 200 and got.json()["run_id"] == run_id, ref
    api.client.post(f"/v1/runs/{run_id}/cancel")
    api.move(run_id, RunStatus.CANCELLED)
    ended = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert ended["action"] == "unavailable" and "the run is cancelled" in ended["reason"]
    assert "against finishing" not in ended["summary"] and ended["extra_gpu_hours"] is None


@pytest.mark.usefixtures("fake_host_env")
def test_the_proposal_prices_the_deployments_own_verifier_from_its_config_json(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    kimi = str(Path(__file__).resolve().parents[1] / "fixtures" / "verifiers" / "kimi-k2.5")
    runs = {}
    for verifier in (None, kimi):
        deploy = {"host": "local", **({"verifier": kimi} if verifier else {})}
        runs[verifier] = run_id = trainer_run(api, deploy=deploy)
        feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
        validate(api, run_id, 1, 100, SHALLOW)
    default = api.client.get(f"/v1/runs/{runs[None]}/proposal").json()
    # the trainer's verifier_path (/m/v) is not readable here: the built-in default, saying so and why
    assert default["verifier"].startswith("built-in default") and "/m/v" in default["terms_basis"]["verifier_forward"]
    own = api.client.get(f"/v1/runs/{runs[kimi]}/proposal").json()
    assert own["verifier"].startswith("kimi-k2.5") and "384 routed experts" in own["verifier"]
    assert own["advice"]["cost_model"]["priced_verifier"] == own["verifier"]
    assert own["terms_basis"]["verifier_forward"].startswith("modelled from kimi-k2.5")
    assert own["terms_basis"]["allreduce_times"].startswith("measured on local by probe-interconnect")
    # no candidate past the deepest TTT the rule's record trained (rule_record.DEEPEST_MEASURED)
    assert [row["ttt"] for row in own["frontier"]] == list(range(4, rule_record.DEEPEST_MEASURED + 1))
    assert all(row["training_hours"] and row["gpu_hours"] for row in own["frontier"])
    # an MoE verifier reads more experts for every token it verifies: deeper rounds cost it more than the dense one
    assert own["advice"]["by_depth"][15]["terms"]["verifier_ms"] > 3 * own["advice"]["by_depth"][0]["terms"][
        "verifier_ms"]


@pytest.mark.usefixtures("fake_host_env")
def test_where_the_retrain_rule_missed_a_probe_is_offered_priced_taken_and_decided(
        api: App, responder: InterconnectResponder, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local"}, on_proposal="restart")
    ttt = 5

    def measured(miss: float) -> tuple[rule_record.Checked, ...]:
        return tuple(rule_record.Checked("tiny", "regenerated", link, 3, to, 0.2, 0.2 / (1 + miss), miss)
                     for link in ("nvlink", "pcie") for to in (ttt, 7))

    # the record within 10%: the restart is proposed, saying what the rule's record is
    monkeypatch.setattr(rule_record, "MEASURED", measured(0.05))
    other = trainer_run(api, deploy={"host": "local"}, max_retries=0)
    feed(api, other, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, other, 1, 100, SHALLOW)
    held = api.client.get(f"/v1/runs/{other}/proposal").json()
    assert held["action"] == "restart", held["summary"]
    assert "the retrain rule held within 10%" in held["rule_record"] and held["rule_record"] in held["summary"]

    # a miss past 10% on a restart from TTT=3 up to the one proposed: no restart on the rule's word; the probe
    # that settles it is offered, priced before it runs, and taken as one action
    monkeypatch.setattr(rule_record, "MEASURED", measured(0.25))
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert got["action"] == "probe", got["summary"]
    offer = got["probe"]
    ttt = offer["ttt"]
    assert got["summary"].startswith(f"probe TTT={ttt}: resume the checkpoint at step 0 at TTT={ttt} for 200 steps")
    assert "missed by +25.0% on a restart like this one" in got["summary"] and got["restart"] is None
    assert offer["steps"] == 200 and offer["restart"] == {"overrides": {"ttt_steps": ttt, "max_steps": 200},
                                                          "resume": True}
    # 200 steps at (1 + TTT) / (1 + 3) x 3 s, on 2 GPUs
    assert offer["predicted_seconds"] == pytest.approx(200 * 3.0 * (1 + ttt) / 4)
    assert offer["gpu_hours"] == pytest.approx(offer["predicted_seconds"] * 2 / 3600)
    assert got["next_step"] and got["auto_restart"].startswith("refused: it would take")
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "running" and run["attempt"] == 1, "past auto_restart_max_factor: not taken by itself"

    taken = api.client.post(f"/v1/runs/{run_id}/proposal/probe")
    assert taken.status_code == 202, taken.text
    probe_spec = taken.json()["attempts"][-1]["spec"]["trainer"]
    assert (probe_spec["ttt_steps"], probe_spec["max_steps"]) == (ttt, 200)
    assert api.client.post(f"/v1/runs/{run_id}/proposal/probe").status_code == 409, "one probe at a time"
    api.move(run_id, RunStatus.LAUNCHING, RunStatus.RUNNING)
    running = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert running["probe"]["status"] == "running" and running["probe"]["attempt"] == 2

    # the probe's validation: its deep positions hold up, so the run continues at the deeper TTT, uncapped again
    feed(api, run_id, 0, {"step": 200, "total_steps": 200, "loss": 2.0}, step_seconds=4.0)
    validate(api, run_id, 1, 200, [0.8, 0.75, 0.7] + [0.65] * 13)
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "restarting" and run["attempt"] == 3
    assert run["attempts"][-1]["spec"]["trainer"]["ttt_steps"] == ttt
    assert "max_steps" not in run["attempts"][-1]["spec"]["trainer"]
    decided = api.client.get(f"/v1/runs/{run_id}/proposal").json()["probe"]
    assert decided["status"] == "decided" and decided["decision"].startswith(f"restart at TTT={ttt}: the probe's")


@pytest.mark.usefixtures("fake_host_env")
def test_the_restarts_dry_run_prices_a_deeper_ttt_from_the_trainers_timed_split(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local"})
    # the attempt's pace (3 s/step) came from eager steps; compiled, the trainer timed 0.5 s + 0.25 s per iteration
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0, "step_fixed_s": 0.5, "ttt_iter_s": 0.25},
         step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    ttt = got["suggested_ttt"]
    assert got["action"] == "restart" and "timed by the trainer over compiled steps" in got["dry_run"]["basis"]
    assert got["predicted_training_seconds"] == pytest.approx(1000 * (0.5 + 0.25 * ttt), rel=0.01)
    # no deploy.serve_tokens: the stated default weighs the training; the pick is the smallest TTT within 1 % of the
    # best net GPU-hours, not the fastest
    assert "the stated default, 1e+09 tokens" in got["objective"]
    nets = {row["ttt"]: row["net_gpu_hours"] for row in got["frontier"] if row["gain"] >= 0.02}
    best = max(nets.values())
    assert ttt == min(t for t, net in nets.items() if net >= best - 0.01 * abs(best))


@pytest.mark.usefixtures("fake_host_env")
def test_a_vllm_release_that_refuses_the_verifier_for_eagle3_is_named_not_priced(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    kimi = str(Path(__file__).resolve().parents[1] / "fixtures" / "verifiers" / "kimi-k2.5")
    run_id = trainer_run(api, deploy={"host": "local", "engine": "vllm", "engine_version": "0.11.0", "verifier": kimi})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert got["action"] == "unavailable" and got["advice"] is None and got["frontier"] == []
    assert got["reason"].startswith("vLLM 0.11.0 refuses an EAGLE-3 draft for a 'kimi_k2' verifier")
    assert "vllm 0.11.0 config/speculative.py:540" in got["reason"] and "deploy.engine: sglang" in got["reason"]
    # vLLM serves Kimi-K2.5 from 0.18.0 (KimiK25ForConditionalGeneration implements SupportsEagle3); a release newer
    # than the newest read is not assumed to
    for version, served in (("0.34.0", True), ("0.35.0", False)):
        later = trainer_run(api, deploy={"host": "local", "engine": "vllm", "engine_version": version,
                                         "verifier": kimi})
        feed(api, later, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
        validate(api, later, 1, 100, SHALLOW)
        answer = api.client.get(f"/v1/runs/{later}/proposal").json()
        assert (answer["action"] != "unavailable") is served, answer
        assert served or "newer than the newest release read for EAGLE-3 targets (0.34.0)" in answer["reason"]
    # SGLang serves it, and prices it as it runs it: dp-attention puts the draft on its own rank
    sglang = trainer_run(api, deploy={"host": "local", "engine": "sglang", "dp_attention": 2, "verifier": kimi})
    feed(api, sglang, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, sglang, 1, 100, SHALLOW)
    served = api.client.get(f"/v1/runs/{sglang}/proposal").json()
    assert served["action"] != "unavailable" and "draft_parallel.py" in served["terms_basis"]["draft_placement"]
    assert "dp-attention (dp 2)" in served["terms_basis"]["verifier_forward"]


@pytest.mark.usefixtures("fake_host_env")
def test_on_proposal_restart_takes_the_probe_within_its_factor_and_the_decision_keeps_going(
        api: App, responder: InterconnectResponder, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(rule_record, "MEASURED", tuple(
        rule_record.Checked("tiny", "regenerated", link, 3, to, 0.2, 0.16, 0.25)
        for link in ("nvlink", "pcie") for to in range(4, 8)))
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local"}, on_proposal="restart", auto_restart_max_factor=4)
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "restarting" and run["attempt"] == 2, "the probe taken by itself"
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert got["probe"]["status"] == "running" and got["auto_restart"].startswith("taken by on_proposal: restart")
    ttt = run["attempts"][-1]["spec"]["trainer"]["ttt_steps"]

    # the probe's deep positions fell as the shallow draft's did: the run goes on at TTT=3, its steps uncapped
    api.move(run_id, RunStatus.LAUNCHING, RunStatus.RUNNING)
    feed(api, run_id, 0, {"step": 200, "total_steps": 200, "loss": 2.0}, step_seconds=4.0)
    validate(api, run_id, 1, 200, SHALLOW)
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["attempt"] == 3 and run["attempts"][-1]["spec"]["trainer"]["ttt_steps"] == 3
    assert "max_steps" not in run["attempts"][-1]["spec"]["trainer"]
    decided = api.client.get(f"/v1/runs/{run_id}/proposal").json()["probe"]
    assert decided["decision"].startswith(f"keep going at TTT=3: the probe's draft (TTT={ttt})")
    # one automatic act per run: attempt 3's proposals are only proposed
    api.move(run_id, RunStatus.LAUNCHING, RunStatus.RUNNING)
    feed(api, run_id, 0, {"step": 300, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 300, SHALLOW)
    assert api.client.get(f"/v1/runs/{run_id}").json()["attempt"] == 3
