"""The bundled trainer driven through the service on the `local` host, as a user would: a warm restart, and a
restart mid-run that stops the trainer at a step.

The TTT=3 run with live per-step metrics, the dry run, a restart at TTT=5 and the evaluation and advice it feeds are
checked through the API by the browser test that drives the same served run from the page
(tests/web/test_trainer_page.py): one served trainer run for both, not two."""

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


def test_warm_restart_starts_from_the_last_draft_even_with_clean(
        service: Service, tiny_verifier: Path, prepared_data: Path, tiny_corpus: Path) -> None:
    spec = _trainer_spec(tiny_verifier, prepared_data, service.workspace / "out", tiny_corpus)
    # one epoch (22 steps on one rank) is enough: the draft's loss_0 falls from about 5.2 to its plateau of about 4.4
    # within the first 10 steps, so attempt 2's first loss_0 tells a warm start from a cold one just as well as after
    # three epochs; each further epoch (and its validation) only cost both attempts time
    spec["trainer"].update(epochs=1, report_to="tensorboard")
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
