"""The restart and cancel a user can predict: the dry run prints the spec diff and whether the new attempt resumes a
checkpoint; stopping a live attempt asks on a terminal (--yes skips); scripts are not asked."""

import io
import json

import pytest

from longrun.exit_codes import ExitCode
from server.lifecycle import RunStatus as S
from server.models import Attempt
from tests.inprocess import App
from tests.longrun.test_cli import exit_code


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def trainer_run(cli: App, out: str = "out") -> dict:
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v",
               "output_dir": str(cli.workspace / out), "ttt_steps": 3, "save_every": 100}
    run = cli.submit(entrypoint=None, trainer=trainer, name="ttt3")
    cli.move(run["id"], S.LAUNCHING, S.RUNNING)
    with cli.session() as s:
        a = s.query(Attempt).filter_by(run_id=run["id"]).one()
        a.last_step, a.total_steps, a.sec_per_step = 570, 1520, 0.5
    return run


def test_a_depth_change_over_a_checkpoint_needs_resume_or_fresh_and_the_dry_run_says_which(
        cli: App, capsys, monkeypatch) -> None:
    run = trainer_run(cli)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    for dry in (["--dry-run"], []):
        # refused before the question: nobody is asked to stop an attempt for a restart that cannot be
        assert exit_code(["restart", "ttt3", "--ttt-steps", "5", *dry]) == ExitCode.REFUSED
        shown = capsys.readouterr()
        assert "?" not in shown.out
        err = shown.err
        assert "trained with 3 TTT steps and this attempt trains 5" in " ".join(err.split()), err
        assert "--start resume / --start fresh" in err, err
    assert cli.client.get(f"/v1/runs/{run['id']}").json()["attempt"] == 1
    assert exit_code(["restart", "ttt3", "--ttt-steps", "5", "--resume", "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # a terminal here: rich wraps at its width
    assert "ttt_steps: 3 -> 5" in out
    assert "start: resume: resumes the checkpoint at step 500" in out and "trained with 3 TTT steps" in out
    assert exit_code(["restart", "ttt3", "--ttt-steps", "5", "--fresh", "--dry-run"]) == 0
    assert "start: fresh:" in capsys.readouterr().out
    assert exit_code(["restart", "ttt3", "--ttt-steps", "5", "--resume", "--yes", "--json"]) == 0
    restarted = cli.client.get(f"/v1/runs/{run['id']}").json()
    assert restarted["attempt"] == 2 and "resumes the checkpoint at step 500" in restarted["message"]


@pytest.mark.parametrize("command", [["cancel", "ttt3"], ["restart", "ttt3", "--ttt-steps", "5", "--start", "fresh"]])
def test_stopping_a_live_attempt_asks_on_a_terminal(cli: App, capsys, monkeypatch, command: list[str]) -> None:
    run = trainer_run(cli)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    assert exit_code(command) == ExitCode.FAILED, "a no exits 1, as apt's does; 130 is Ctrl-C's"
    shown = capsys.readouterr()
    asked = shown.out
    assert "?" in asked and "not confirmed: nothing was done" in shown.err
    if command[0] == "restart":
        assert "relaunch it (fresh: clean empties" in " ".join(asked.split()), "the question says how it starts"
    assert cli.client.get(f"/v1/runs/{run['id']}").json()["status"] == "running", "a no changes nothing"
    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    assert exit_code([*command, "--json"]) == 0
    assert cli.client.get(f"/v1/runs/{run['id']}").json()["status"] in ("cancelling", "restarting")


def test_scripts_and_yes_are_not_asked(cli: App, monkeypatch) -> None:
    run = trainer_run(cli)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal: as before, no question
    assert exit_code(["cancel", "ttt3"]) == 0
    again = trainer_run(cli, "out2")  # the first one's checkpoint is not its to continue
    monkeypatch.setattr("sys.stdin", Terminal(""))
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    assert exit_code(["restart", again["id"], "--yes"]) == 0
    assert cli.client.get(f"/v1/runs/{run['id']}").json()["status"] == "cancelling"


@pytest.mark.parametrize(("spelling", "start"), [(["--start", "fresh"], "fresh"), (["--fresh"], "fresh"),
                                                 (["--clean"], "fresh"), (["--start", "resume"], "resume"),
                                                 (["--resume"], "resume")])
def test_one_way_to_say_where_a_deeper_restart_starts_and_the_old_spellings_still_work(
        cli: App, capsys, spelling: list[str], start: str) -> None:
    trainer_run(cli)
    assert exit_code(["restart", "ttt3", "--ttt-steps", "5", *spelling, "--dry-run"]) == 0
    assert f"start: {start}:" in " ".join(capsys.readouterr().out.split())


def test_a_warm_start_trains_from_step_0_from_the_last_draft_and_two_starts_are_a_usage_error(cli: App, capsys) -> None:
    run = trainer_run(cli)
    for spelling in (["--start", "warm"], ["--init-from-last"]):
        assert exit_code(["restart", "ttt3", "--ttt-steps", "5", *spelling, "--dry-run", "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["start"] == "fresh" and answer["new_spec"]["trainer"]["init_from"], answer
    assert exit_code(["restart", "ttt3", "--ttt-steps", "5", "--start", "fresh", "--resume"]) == ExitCode.USAGE
    assert "say one start: fresh or resume" in capsys.readouterr().err
    assert cli.client.get(f"/v1/runs/{run['id']}").json()["attempt"] == 1


def evaluating_run(cli: App) -> dict:
    """A live run whose attempt trained its last step: its final validation, evaluation and export run."""
    run = trainer_run(cli)
    with cli.session() as s:
        a = s.query(Attempt).filter_by(run_id=run["id"]).one()
        a.last_step, a.total_steps = 1520, 1520
    return run


def test_a_restart_during_the_final_evaluation_waits_for_it_to_end(cli: App, capsys, monkeypatch) -> None:
    run = evaluating_run(cli)
    ended = []

    def evaluation_ends(seconds: float) -> None:  # the worker's part: the attempt's evaluation ends meanwhile
        if not ended:
            cli.move(run["id"], S.SUCCEEDED)
            with cli.session() as s:
                s.query(Attempt).filter_by(run_id=run["id"]).one().status = "succeeded"
            ended.append(True)

    monkeypatch.setattr("longrun.commands.runs.time.sleep", evaluation_ends)
    assert exit_code(["restart", "ttt3", "--ttt-steps", "5", "--start", "fresh"]) == 0
    assert "to end its final evaluation" in capsys.readouterr().err
    after = cli.client.get(f"/v1/runs/{run['id']}").json()
    assert ended and after["attempt"] == 2, "restarted once the evaluation had ended"
    assert after["attempts"][0]["status"] == "succeeded", "the evaluation was not stopped"


def test_on_a_terminal_a_restart_during_the_final_evaluation_asks_and_a_no_stops_it_now(
        cli: App, capsys, monkeypatch) -> None:
    run = evaluating_run(cli)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    monkeypatch.setattr("longrun.commands.runs.time.sleep", lambda s: pytest.fail("a no does not wait"))
    assert exit_code(["restart", "ttt3", "--ttt-steps", "5", "--start", "fresh"]) == 0
    assert "is in its final evaluation. Wait for it to end" in " ".join(capsys.readouterr().out.split())
    assert cli.client.get(f"/v1/runs/{run['id']}").json()["status"] == "restarting"
