"""The bundled trainer driven through the service on the `local` host, as a user would: a TTT=3 run
with live per-step metrics, the dry run, a restart at TTT=5, and the evaluation and advice it feeds."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import Service, kill_leftovers

pytestmark = pytest.mark.slow  # a real server running the trainer under torchrun


def _trainer_spec(verifier: Path, data: Path, out: Path, corpus: Path) -> dict:
    return {"name": "eagle3", "host": "local", "nproc_per_node": 2,
            "trainer": {"verifier_path": str(verifier), "data_dir": str(data / "hidden_states"),
                        "vocab_mapping_dir": str(data / "vocab_mapping"), "output_dir": str(out),
                        "epochs": 10, "lr": 3e-3, "max_seq_len": 64, "num_workers": 0, "ttt_steps": 3,
                        "noise_std": 0.05, "scheduler": "cosine", "warmup_ratio": 0.01, "val_ratio": 0.1,
                        "eval_corpus": str(corpus), "eval_max_depth": 4, "eval_samples": 2,
                        "eval_new_tokens": 16}}


def test_ttt3_run_then_restart_at_ttt5_through_the_service(
        service: Service, tiny_verifier: Path, prepared_data: Path, tiny_corpus: Path) -> None:
    spec = _trainer_spec(tiny_verifier, prepared_data, service.workspace / "out", tiny_corpus)
    run = service.submit(spec)
    # an ETA needs a step rate, so at least two metric reads: wait for it rather than race the first one
    live = service.wait(run["id"], lambda r: r["status"] == "running" and "acc_2" in r["latest"]
                        and r["eta_seconds"] is not None, what="live metrics with an ETA")
    assert {"loss_0", "loss_1", "loss_2", "cond_acc_2", "lr", "grad_norm", "tokens_per_s"} <= set(live["latest"])
    assert "loss_3" not in live["latest"], "a TTT=3 draft reports exactly three steps"
    assert live["eta_seconds"] is not None and live["progress"] is not None

    first = service.wait_status(run["id"], "succeeded", "failed", timeout=300)
    assert first["status"] == "succeeded", service.logs(run["id"], tail=40)
    losses = service.series(run["id"], "loss", attempt=1)
    assert losses[-1]["value"] < losses[0]["value"], "training lowers the loss"
    report = service.client.get(f"/v1/runs/{run['id']}/evaluation").json()
    assert report["attempt"] == 1 and report["ttt_steps"] == 3
    taus = [row["mean_accepted"] for row in report["by_depth"]]
    assert len(taus) == 4 and 1.0 <= taus[0] <= 2.0 and taus == sorted(taus)

    change = {"overrides": {"ttt_steps": 5}, "clean": True}
    dry = service.client.post(f"/v1/runs/{run['id']}/restart", params={"dry_run": "true"}, json=change).json()
    measured = first["attempts"][0]["seconds_per_step"]
    assert dry["predicted_duration_seconds"] > first["attempts"][0]["total_steps"] * measured, \
        "two more TTT steps per step cost more than the measured pace"
    assert "TTT=3" in dry["basis"]

    restarted = service.client.post(f"/v1/runs/{run['id']}/restart", json=change)
    assert restarted.status_code == 202, restarted.text
    second = service.wait(run["id"], lambda r: r["attempt"] == 2 and "loss_4" in r["latest"], timeout=120,
                          what="attempt 2 reporting loss_4")
    assert second["attempts"][1]["spec"]["trainer"]["ttt_steps"] == 5
    done = service.wait_status(run["id"], "succeeded", "failed", timeout=300)
    assert done["status"] == "succeeded"
    assert done["attempts"][1]["prediction_error"] is not None
    assert {r["ttt_steps"] for r in service.client.get(f"/v1/runs/{run['id']}/evaluation").json()["by_attempt"]} == {3, 5}
    for link in ("pcie", "nvlink"):
        advice = service.client.get(f"/v1/runs/{run['id']}/advice", params={"interconnect": link, "tp": 8})
        assert advice.status_code == 200, advice.text
        body = advice.json()
        assert body["attempt"] == 2 and body["recommended_depth"] in range(0, 5)
        assert body["retrain"]["trained_ttt"] == 5


def test_warm_restart_starts_from_the_last_draft_even_with_clean(
        service: Service, tiny_verifier: Path, prepared_data: Path, tiny_corpus: Path) -> None:
    spec = _trainer_spec(tiny_verifier, prepared_data, service.workspace / "out", tiny_corpus)
    spec["trainer"].update(epochs=3, report_to="tensorboard")
    spec["nproc_per_node"] = 1  # what it asserts holds for one rank as for two; two ranks are the other tests'
    del spec["trainer"]["eval_corpus"]
    run = service.submit(spec)
    assert service.wait_status(run["id"], "succeeded", "failed", timeout=300)["status"] == "succeeded"
    r = service.client.post(f"/v1/runs/{run['id']}/restart",
                            json={"overrides": {"ttt_steps": 5}, "clean": True, "init_from_last": True})
    assert r.status_code == 202, r.text
    stash = r.json()["attempts"][1]["spec"]["trainer"]["init_from"]
    assert stash.startswith(str(service.workspace / ".longrun" / run["id"]))
    done = service.wait_status(run["id"], "succeeded", "failed", timeout=300)
    assert done["status"] == "succeeded", service.logs(run["id"], tail=40)
    assert any(f"initialised the draft from {stash}" in line for line in service.logs(run["id"], tail=400))
    assert (Path(stash) / "model.safetensors").exists()
    first, second = (service.series(run["id"], "loss_0", attempt=n) for n in (1, 2))
    assert second[0]["step"] == 1, "a fresh schedule, not a resume of attempt 1's checkpoints"
    assert second[0]["value"] < first[0]["value"], "warm: it starts where the TTT=3 draft ended"

    # one TensorBoard run for both attempts, kept through the clean restart: attempt 2 follows attempt 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(service.workspace / ".longrun" / run["id"] / "tracking" / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("train/loss_0")] == list(range(1, len(first) + len(second) + 1))
    assert [e.value for e in board.Scalars("train/loss_0")] == pytest.approx([p["value"] for p in first + second])
    assert [(e.step, e.value) for e in board.Scalars("longrun/attempt")] == [(1, 1.0), (len(first) + 1, 2.0)]


@pytest.fixture
def patient_service(tmp_path: Path) -> Iterator[Service]:
    """A service whose cancel grace outlasts a training step on a loaded 2-core machine (the default 5 s
    does not), so that a SIGKILL can only mean the ranks did not stop at a step."""
    svc = Service(tmp_path / "home", cancel_grace=30)
    svc.home.mkdir()
    svc.start()
    yield svc
    svc.stop()
    kill_leftovers(svc.workspace)


def test_restart_mid_run_stops_the_trainer_at_a_step_not_by_sigkill(
        patient_service: Service, tiny_verifier: Path, prepared_data: Path, tiny_corpus: Path) -> None:
    # With data-loader workers, as in production: the cancel's SIGTERM reaches every process of the run.
    # Seen on two H200s: a worker dying under its rank left the other rank in an NCCL all-reduce until
    # the grace ran out and the attempt was SIGKILLed (exit 137).
    service = patient_service
    spec = _trainer_spec(tiny_verifier, prepared_data, service.workspace / "out", tiny_corpus)
    spec["trainer"].update(epochs=500, num_workers=2)
    del spec["trainer"]["eval_corpus"]
    run = service.submit(spec)
    service.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 5, what="attempt 1 training")
    r = service.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"ttt_steps": 5}, "resume": True})
    assert r.status_code == 202, r.text
    second = service.wait(run["id"], lambda r: r["attempt"] == 2 and "loss_4" in r["latest"], timeout=120,
                          what="attempt 2 reporting loss_4")
    first = second["attempts"][0]
    log = service.logs(run["id"], attempt=1, tail=50)
    assert any("stopping at step" in line for line in log), log[-20:]
    assert first["exit_code"] != 137, "attempt 1 had to be SIGKILLed"
    service.client.post(f"/v1/runs/{run['id']}/cancel")
    assert service.wait_status(run["id"], "cancelled", timeout=60)["attempts"][1]["exit_code"] != 137
