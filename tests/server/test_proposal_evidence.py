"""The proposal's acceptance evidence, in-process: the live sim_acc_k alone until an evaluation of the run exists,
then decoding calibrating them per position, named with its interval in the proposal, its summary and its event."""

import pytest

from server.lifecycle import RunStatus
from tests.inprocess import App
from tests.server.test_interconnect_api import fake_host_env, probe, responder  # noqa: F401 - fixtures
from tests.server.test_proposal import events, feed, trainer_run, validate
from worker.interconnect import InterconnectResponder

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
    assert simulated["summary"].endswith("evidence: simulation (sim_acc_k, not yet checked against decoding)")

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
                                       f"position, the proposed TTT's gain {low:+.1%} to {high:+.1%} over decoding's "
                                       "90% interval)")
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
