"""The proposal's acceptance evidence, in-process: the live sim_acc_k alone until an evaluation of the run exists,
then decoding calibrating them per position, named with its interval in the proposal, its summary and its event."""

import pytest

from server.config import Settings
from server.lifecycle import RunStatus
from tests.inprocess import App
from tests.server.test_interconnect_api import fake_host_env, probe, responder  # noqa: F401 - fixtures
from tests.server.test_proposal import events, feed, trainer_run, validate
from tests.worker.test_notifier import wait_for
from tests.worker.webhook_receiver import Receiver
from worker.interconnect import InterconnectResponder
from worker.notifier import WebhookNotifier

# what a restart proposal does once made: the retrain rule's record as one that held (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rule_trusted", "rule_unbounded")

# the TTT=3 draft: the simulation past its trained depth above the decay inside it (keep going) ...
SIM = [0.9, 0.85, 0.84, 0.88, 0.87, 0.86]
# ... while real decoding of the same draft falls below it past depth 3
DECODED = [0.95, 0.95, 0.948, 0.80, 0.75, 0.70]
INTERVAL = [[a - 0.02, min(1.0, a + 0.02)] for a in DECODED]


def evaluation(conditional: list[float]) -> dict:
    position, running = [], 1.0
    for a in conditional:
        running *= a
        position.append(running)
    return {"evaluation": {"position_acceptance": position, "conditional_acceptance": conditional,
                           "conditional_acceptance_interval": INTERVAL, "position_rounds": [100] * len(conditional),
                           "by_depth": [{"depth": d, "mean_accepted": 1 + sum(position[:d])} for d in range(1, 7)]}}


def simulated_run(api: App, responder: InterconnectResponder) -> str:  # noqa: F811
    """A TTT=3 run served by SGLang on `local` (its all-reduce table probed), validated once with SIM."""
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SIM)
    return run_id


@pytest.mark.usefixtures("fake_host_env")
def test_decoding_calibrates_the_simulation_once_an_evaluation_exists_and_every_answer_names_it(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    run_id = simulated_run(api, responder)
    url = f"/v1/runs/{run_id}/proposal"
    simulated = api.client.get(url).json()
    assert simulated["action"] == "keep_going", simulated["summary"]
    assert simulated["evidence"]["source"] == "simulation" and simulated["evidence"]["acceptance"] == SIM
    assert simulated["summary"].endswith("evidence: simulation (sim_acc_k, not yet checked against decoding; the decay "
                                         "read from sim_acc_k: this run reports no sim_step_acc_k)")

    # the attempt's evaluation (its end): decoding decides, read as decoded at the positions it measured
    feed(api, run_id, 2, evaluation(DECODED))
    decoded = api.client.get(url).json()
    evidence = decoded["evidence"]
    assert evidence["source"] == "decoding" and evidence["attempt"] == 1
    assert evidence["acceptance"] == pytest.approx(DECODED)
    assert evidence["acceptance_interval"] == [pytest.approx(b) for b in INTERVAL]
    assert decoded["sim_acc"] == SIM, "the simulation is still shown as it is"
    assert decoded["action"] == "restart", decoded["summary"]
    low, high = evidence["gain_interval"]
    assert low <= decoded["gain"] <= high
    assert decoded["summary"].endswith(f"evidence: decoding (attempt 1's evaluation calibrating sim_acc_k per "
                                       "position; the decay read from sim_acc_k: this run reports no sim_step_acc_k, "
                                       f"the gain {low:+.1%} to {high:+.1%} over decoding's 90% intervals)")
    # one proposal event per verdict: the simulation's, then decoding's
    stream = [data for kind, data in events(api, run_id) if kind == "proposal"]
    assert [data["evidence"]["source"] for data in stream] == ["simulation", "decoding"]


@pytest.mark.usefixtures("fake_host_env")
def test_an_earlier_attempts_decoding_scales_the_live_simulation_by_its_ratio(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    run_id = simulated_run(api, responder)
    feed(api, run_id, 2, evaluation(DECODED))
    r = api.client.post(f"/v1/runs/{run_id}/restart", json={"overrides": {"ttt_steps": 5}, "clean": True})
    assert r.status_code == 202, r.text
    api.move(run_id, RunStatus.LAUNCHING, RunStatus.RUNNING)
    live = [0.92, 0.9, 0.9, 0.9, 0.88, 0.86]
    validate(api, run_id, 0, 50, live)
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()["evidence"]
    assert got["source"] == "decoding" and got["attempt"] == 1
    ratios = [d / s for d, s in zip(DECODED, SIM, strict=True)]
    assert got["calibration"] == pytest.approx(ratios)
    assert got["acceptance"] == pytest.approx([min(1.0, a * f) for a, f in zip(live, ratios, strict=True)])


# what the current trainer reports beside sim_acc_k: the step rates past TTT=3 fall (the draft gets worse there)
# while sim_acc_k, over the rounds that survived, holds up (SIM)
FALLING = [0.9, 0.8, 0.72, 0.5, 0.4, 0.3]


def with_counts(conditional: list[float], step: list[float], rounds: int) -> dict:
    """A current trainer's validation: sim_acc_k and sim_step_acc_k with the rounds behind each."""
    out, reaching = {}, float(rounds)
    for k, (a, u) in enumerate(zip(conditional, step, strict=True), 1):
        out |= {f"sim_acc_{k}": a, f"sim_step_acc_{k}": u, f"sim_rounds_{k}": round(reaching),
                f"sim_scored_{k}": rounds}
        reaching *= a
    return out


@pytest.mark.usefixtures("fake_host_env")
def test_step_rates_falling_past_ttt_restart_and_too_few_rounds_cannot_tell_on_every_surface(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
    url = f"/v1/runs/{run_id}/proposal"
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    feed(api, run_id, 1, {"step": 100, "val_loss": 1.0, **with_counts(SIM, FALLING, 100_000)})
    got = api.client.get(url).json()
    evidence = got["evidence"]
    # sim_acc_k alone says keep going (the first test); the survivor-bias-free rate says the draft falls past TTT
    assert got["action"] == "restart" and got["suggested_ttt"] > 3, got["summary"]
    assert evidence["source"] == "simulation" and evidence["decay_from"] == "sim_step_acc_k"
    assert evidence["step_acceptance"] == FALLING and "survivor bias" in evidence["decay_note"]
    assert evidence["rounds"][0] == 100_000 and len(evidence["step_acceptance_interval"]) == 6
    low, high = evidence["step_acceptance_interval"][3]
    assert low < 0.5 < high and high - low < 0.01, "a Wilson 90% interval over 100,000 rounds"
    assert set(evidence["verdicts"]) == {"restart"}
    g_low, g_high = evidence["gain_interval"]
    assert 0.02 < g_low <= got["gain"] <= g_high
    assert "evidence: simulation (sim_acc_k over 100000 validation rounds" in got["summary"]
    assert "the decay read from sim_step_acc_k" in got["summary"]
    # the lift is the step rule's: position 4 on from what sim_acc_k gives now
    assert got["predicted_position_acceptance_after"][3] > SIM[0] * SIM[1] * SIM[2] * SIM[3]

    # the same rates over 60 rounds: their intervals hold a restart and a keep going
    feed(api, run_id, 2, {"step": 200, "val_loss": 1.0, **with_counts(SIM, FALLING, 60)})
    unsure = api.client.get(url).json()
    evidence = unsure["evidence"]
    assert unsure["action"] == "cannot_tell", unsure["summary"]
    assert unsure["restart"] is None and unsure["suggested_ttt"] is None, "nothing to restart on, by hand or not"
    assert set(evidence["verdicts"]) == {"restart", "keep_going"}
    g_low, g_high = evidence["gain_interval"]
    assert g_low < 0.02 < g_high
    assert unsure["summary"].startswith("cannot tell yet: at the measured acceptance the advisor says restart at TTT=")
    assert f"the gain runs {g_low:+.1%} to {g_high:+.1%}" in unsure["summary"]
    # what settles it: how many times the 60 rounds, or an evaluation
    assert "x the 60 validation rounds (trainer.sim_samples" in evidence["settle"]
    assert "or an evaluation of the run" in evidence["settle"] and evidence["settle"] in unsure["summary"]

    # the SSE stream carries one proposal per verdict, each naming its evidence
    stream = [data for kind, data in events(api, run_id) if kind == "proposal"]
    assert [data["action"] for data in stream] == ["restart", "cannot_tell"]
    assert stream[1]["evidence"]["settle"] == evidence["settle"] and stream[1]["summary"] == unsure["summary"]


@pytest.mark.usefixtures("fake_host_env")
def test_an_older_trainers_run_without_step_rates_falls_back_to_sim_acc_and_says_so(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    run_id = simulated_run(api, responder)  # sim_acc_k only: no sim_step_acc_k, no sim_rounds_k
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    evidence = got["evidence"]
    assert got["action"] == "keep_going", got["summary"]
    assert evidence["decay_from"] == "sim_acc_k" and evidence["step_acceptance"] == []
    assert "reports no sim_step_acc_k" in evidence["decay_note"] and "falls back" in evidence["decay_note"]
    assert "survivor bias" in evidence["decay_note"]
    assert evidence["interval"].startswith("none: this run reports no sim_rounds_k")
    assert evidence["acceptance_interval"] == [] and evidence["verdicts"] == [] and evidence["gain_interval"] is None
    assert "this run reports no sim_step_acc_k" in got["summary"]


@pytest.mark.usefixtures("fake_host_env")
def test_decodings_calibration_carries_onto_the_step_rates(api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    flat = [0.9, 0.85, 0.8, 0.8, 0.8, 0.8]
    feed(api, run_id, 1, {"step": 100, "val_loss": 1.0, **with_counts(SIM, flat, 100_000)})
    feed(api, run_id, 2, evaluation(DECODED) | {"step": 100})
    got = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    evidence = got["evidence"]
    assert evidence["source"] == "decoding" and evidence["decay_from"] == "sim_step_acc_k"
    ratios = [d / s for d, s in zip(DECODED, SIM, strict=True)]
    assert evidence["step_acceptance"] == pytest.approx([min(1.0, u * f) for u, f in zip(flat, ratios, strict=True)])
    assert "the live sim_step_acc_k are calibrated by the same ratios" in evidence["detail"]
    assert got["action"] == "restart", got["summary"]


@pytest.mark.usefixtures("fake_host_env")
def test_the_webhook_says_cannot_tell_with_what_settles_it(api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    receiver = Receiver()
    notifier = WebhookNotifier(api.db, Settings(home=api.settings.home, webhook_url=receiver.url))
    try:
        run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
        feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
        feed(api, run_id, 1, {"step": 100, "val_loss": 1.0, **with_counts(SIM, FALLING, 60)})
        settle = api.client.get(f"/v1/runs/{run_id}/proposal").json()["evidence"]["settle"]
        queued = [n for n in notifier.run_once() if n.event == "proposal"]
        assert len(queued) == 1 and queued[0].message.startswith("cannot tell yet: ")
        wait_for("the proposal call", lambda: len(receiver.delivered()) == 1, timeout=20)
        message = receiver.delivered()[0]["message"]
        assert settle in message and "the decay read from sim_step_acc_k" in message
    finally:
        notifier.close()
        receiver.close()
