"""A run whose entrypoint is not longrun's trainer, and writes no metrics file, shows progress, loss and an ETA
read from what it prints, through the real service (`local` host, torchrun)."""

from collections import Counter
from pathlib import Path

import pytest

from server.log_patterns import total_from_arguments
from tests import shared_service as shared
from tests.service import STUB_ENV, Service

shared_servers, shared_service = shared.shared_servers, shared.shared_service  # fixtures

FOREIGN = str(Path(__file__).resolve().parent.parent / "fixtures" / "trainer_logs" / "foreign_trainer.py")


def foreign_spec(steps: int, sleep: float, *args: str, **extra: object) -> dict:
    return {"name": "foreign", "host": "local", "nproc_per_node": 1, "entrypoint": FOREIGN,
            "args": ["--steps", str(steps), "--sleep", str(sleep), *args], "env": STUB_ENV, **extra}


@pytest.mark.slow  # on the module's shared server (tests/shared_service.py): `service` marks its own
def test_a_tqdm_bar_and_log_lines_give_progress_loss_and_eta(shared_service: Service) -> None:
    run = shared_service.submit(foreign_spec(60, 0.1))
    running = shared_service.wait(run["id"], lambda r: r["status"] == "running" and 0.2 < (r["progress"] or 0) < 0.8
                                  and r["eta_seconds"] is not None, what="progress and an ETA from the log")
    step = running["latest"]["step"]
    assert running["latest"]["total_steps"] == 60 and running["progress"] == step / 60
    # 0.1 s a step: the ETA is about the steps left at that pace
    assert 0 < running["eta_seconds"] < (60 - step) * 0.1 * 3 + 2
    assert running["latest"]["loss"] > 0
    done = shared_service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert done["progress"] == 1.0 and done["eta_seconds"] == 0.0
    attempt = done["attempts"][0]
    assert attempt["last_step"] == 60 and attempt["total_steps"] == 60
    assert 0.05 < attempt["seconds_per_step"] < 0.3, attempt["seconds_per_step"]
    loss = shared_service.series(run["id"], "loss")
    steps = [p["step"] for p in loss]
    assert steps == sorted(steps) and steps[-1] == 60 and len(set(steps)) > 20
    assert abs(loss[-1]["value"] - 4.0 / 60) < 1e-4 and done["latest"]["loss"] == loss[-1]["value"]
    # the logging lines printed into the bar's line: one point each, at its step
    assert [p["step"] for p in shared_service.series(run["id"], "grad_norm")] == [10, 20, 30, 40, 50, 60]
    assert not shared_service.series(run["id"], "lr"), "the configuration line is no progress"
    assert any("INFO done" in line for line in shared_service.logs(run["id"], tail=20))


@pytest.mark.slow  # on the module's shared server (tests/shared_service.py): `service` marks its own
def test_a_pattern_reads_a_format_of_the_runs_own(shared_service: Service) -> None:
    pattern = r"it (?P<step>\d+) of (?P<total_steps>\d+) \| objective (?P<objective>\S+)"
    run = shared_service.submit(foreign_spec(30, 0.05, "--style", "custom", log_metrics={"patterns": [pattern]}))
    done = shared_service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded" and done["progress"] == 1.0
    objective = shared_service.series(run["id"], "objective")
    assert [p["step"] for p in objective] == list(range(1, 31))
    assert objective[0]["value"] == 4.0 and done["latest"]["objective"] == round(4.0 / 30, 4)


def test_metrics_read_from_the_log_are_stored_once_across_a_server_crash(service: Service) -> None:
    run = service.submit(foreign_spec(50, 0.1))
    service.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 15, what="first steps")
    service.kill()  # SIGKILL: the worker dies between reads; the job goes on writing its log
    service.start()
    done = service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded" and done["progress"] == 1.0
    assert [p["step"] for p in service.series(run["id"], "grad_norm")] == [10, 20, 30, 40, 50]
    per_step = Counter(p["step"] for p in service.series(run["id"], "loss"))
    assert max(per_step.values()) <= 3, per_step  # a redraw or two per step, never the log read twice


def test_a_bad_pattern_or_a_pattern_on_a_trainer_run_is_a_422_naming_the_field(service: Service) -> None:
    bad = service.client.post("/v1/runs", json=foreign_spec(5, 0.1, log_metrics={"patterns": ["ok (?P<a>\\d+)",
                                                                                               "(?P<loss>[0-9."]}))
    assert bad.status_code == 422, bad.text
    [error] = bad.json()["detail"]
    assert error["loc"] == ["body", "log_metrics", "patterns", 1] and "not a regular expression" in error["msg"]
    no_group = service.client.post("/v1/runs", json=foreign_spec(5, 0.1, log_metrics={"patterns": ["loss (\\d+)"]}))
    assert no_group.status_code == 422 and "named group" in no_group.text
    unknown = service.client.post("/v1/runs", json=foreign_spec(5, 0.1, log_metrics={"formats": ["csv"]}))
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"][:3] == ["body", "log_metrics", "formats"]
    trainer = {"verifier_path": "/v", "data_dir": "/d", "vocab_mapping_dir": "/m", "output_dir": "/o"}
    mixed = service.client.post("/v1/runs", json={"name": "t", "host": "local", "trainer": trainer,
                                                  "log_metrics": {"total_steps": 10}})
    assert mixed.status_code == 422 and "`log_metrics` goes with `entrypoint`" in mixed.text
    assert service.client.get("/v1/runs").json()["items"] == []


@pytest.mark.slow  # on the module's shared server (tests/shared_service.py): `service` marks its own
def test_the_total_comes_from_the_trainers_arguments_else_the_answer_says_how_to_give_one(
        shared_service: Service) -> None:
    run = shared_service.submit(foreign_spec(400, 0.05, "--style", "untotalled", "--max-steps", "40"))
    running = shared_service.wait(run["id"], lambda r: r["status"] == "running" and 0 < (r["progress"] or 0) < 1,
                                  what="progress from --max-steps")
    assert running["latest"]["total_steps"] == 40 and running["progress_note"] is None
    assert shared_service.wait_status(run["id"], "succeeded", "failed")["attempts"][0]["last_step"] == 40

    run = shared_service.submit(foreign_spec(400, 0.05, "--style", "untotalled"))
    running = shared_service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) > 2,
                                  what="steps without a total")
    assert running["progress"] is None and "log_metrics.total_steps" in running["progress_note"]
    shared_service.client.post(f"/v1/runs/{run['id']}/cancel")
    shared_service.wait_status(run["id"], "cancelled", "failed")


def test_totals_read_from_speculators_and_specforge_arguments() -> None:
    assert total_from_arguments(["scripts/train.py", "--epochs", "3", "--max-steps", "500"]) == 500  # speculators
    assert total_from_arguments(["--config", "c.yaml", "training.max_steps=1200"]) == 1200  # SpecForge override
    assert total_from_arguments(["--training.num-epochs=2", "--num-samples", "1000", "--training.batch-size", "4",
                                 "--training.accumulation-steps", "2"], ranks=8) == 32  # 2 x 1000 / (4 x 2 x 8), up
    assert total_from_arguments(["--epochs", "3", "--lr", "3e-5"]) is None  # no samples: no total
