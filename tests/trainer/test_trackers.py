"""--report-to: one TensorBoard run per longrun run across retries and restarts, read back as TensorBoard
reads it; a tracker that is not installed is named and skipped."""

import json
import sys
from pathlib import Path

import pytest

from tests.trainer.test_train import read_metrics, tiny, train_command  # noqa: F401 (fixtures)
from trainer.trackers import Trackers, parse_report_to, tracked_run
from trainer.train import parse_args


def scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # not at collection

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def attempt(records: Path, number: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the worker sets for the job of attempt `number` of run `r1`."""
    monkeypatch.setenv("LONGRUN_ATTEMPT_DIR", str(records / "r1" / str(number)))


def log_steps(trackers: Trackers, steps: range, base: float) -> None:
    for step in steps:
        trackers.log({"step": step, "total_steps": 100, "time": 1000.0 + step, "loss": base + step, "acc_0": 0.5,
                      "evaluation": {"by_depth": []}, "stopped": True})
    trackers.close()


def test_a_resumed_attempt_replaces_what_its_crashed_predecessor_logged_past_the_checkpoint(tmp_path, monkeypatch):
    records = tmp_path / "records"
    attempt(records, 1, monkeypatch)
    log_steps(Trackers(["tensorboard"], tracked_run(tmp_path / "out")), range(1, 9), base=100)  # crashed after 8
    attempt(records, 2, monkeypatch)
    log_steps(Trackers(["tensorboard"], tracked_run(tmp_path / "out")), range(6, 11), base=200)  # checkpoint at 5
    attempt(records, 3, monkeypatch)
    log_steps(Trackers(["tensorboard"], tracked_run(tmp_path / "out")), range(1, 4), base=300)  # a clean restart
    board = records / "r1" / "tracking" / "tensorboard"
    assert scalars(board, "train/loss") == [(s, 100 + s) for s in range(1, 6)] + [(s, 200 + s) for s in range(6, 11)] \
        + [(10 + s, 300 + s) for s in range(1, 4)]
    assert scalars(board, "longrun/attempt") == [(1, 1.0), (6, 2.0), (11, 3.0)]
    assert scalars(board, "train/acc_0")[0] == (1, 0.5)
    assert json.loads((records / "r1" / "tracking" / "longrun-steps.json").read_text()) == {
        "attempts": 3, "offset": 10, "last_step": 13}


def test_a_tracker_that_is_not_installed_is_named_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    monkeypatch.delenv("LONGRUN_ATTEMPT_DIR", raising=False)
    run = tracked_run(tmp_path / "out")
    assert run.directory == (tmp_path / "out" / "tracking").resolve() and run.name.startswith("out-")
    log_steps(Trackers(["wandb", "tensorboard"], run), range(1, 4), base=0)
    assert "[trackers] wandb is not installed (pip install wandb); not reporting to it" in capsys.readouterr().out
    assert [s for s, _ in scalars(run.directory / "tensorboard", "train/loss")] == [1, 2, 3]


def test_report_to_names_known_trackers_only(capsys):
    assert parse_report_to("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert parse_report_to("none") == []
    with pytest.raises(SystemExit):
        parse_args(["--verifier-path", "/v", "--data-dir", "/d", "--vocab-mapping-dir", "/m", "--output-dir", "/o",
                    "--report-to", "mlflow"])
    assert "unknown tracker mlflow" in capsys.readouterr().err


def test_the_trainer_keeps_one_tensorboard_run_across_a_resume_and_a_clean_restart(tiny, tmp_path, in_process,  # noqa: F811
                                                                                   monkeypatch):
    records, out, fresh = tmp_path / "records", tmp_path / "out", tmp_path / "fresh"
    flags = dict(scheduler="constant", warmup_ratio=0, epochs=2, report_to="tensorboard")
    attempt(records, 1, monkeypatch)
    assert in_process(train_command(tiny, out, max_steps=6, **flags)) == 0
    attempt(records, 2, monkeypatch)  # a retry: resumes from the checkpoint at step 6
    assert in_process(train_command(tiny, out, max_steps=10, **flags)) == 0
    attempt(records, 3, monkeypatch)  # a clean restart with a warm start: its steps begin at 1
    assert in_process(train_command(tiny, fresh, max_steps=3, init_from=out, **flags)) == 0

    board = records / "r1" / "tracking" / "tensorboard"
    logged = scalars(board, "train/loss")
    resumed, _ = read_metrics(out)
    restarted, _ = read_metrics(fresh)
    assert [s for s, _ in logged] == list(range(1, 14))
    assert [v for _, v in logged] == pytest.approx([r["loss"] for r in resumed + restarted])
    assert scalars(board, "longrun/attempt") == [(1, 1.0), (7, 2.0), (11, 3.0)]
    assert [s for s, _ in scalars(board, "train/acc_2")] == list(range(1, 14))
    assert scalars(board, "train/ttt_steps")[-1] == (13, 3.0)


def test_wandb_offline_keeps_one_run_id_across_attempts_and_tags_each(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B is optional: pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = tmp_path / "records"
    for number, steps in ((1, range(1, 6)), (2, range(4, 8))):
        attempt(records, number, monkeypatch)
        log_steps(Trackers(["wandb"], tracked_run(tmp_path / "out")), steps, base=100 * number)
    sessions = sorted((records / "r1" / "tracking" / "wandb").glob("offline-run-*-r1"))
    assert len(sessions) == 2  # one W&B run, r1, resumed by the second attempt
    first, second = ((s / "run-r1.wandb").read_bytes() for s in sessions)
    assert b"attempt-1" in first and b"attempt-2" in second and b"attempt-2" not in first
    assert b"train/loss" in second and b"longrun/attempt" in second


def test_the_attempt_dir_is_found_after_a_library_rebinds_os_environ(tmp_path, monkeypatch):
    """`datasets`' map(num_proc=…) leaves a copy of os.environ bound in its place; a tracker found under longrun
    must still see what the worker set (this once sent a run's TensorBoard to the output directory)."""
    import copy
    import os
    monkeypatch.setattr(os, "environ", copy.deepcopy(os.environ))
    attempt(tmp_path / "records", 2, monkeypatch)
    run = tracked_run(tmp_path / "out")
    assert (run.name, run.attempt, run.directory) == ("r1", 2, tmp_path / "records" / "r1" / "tracking")
