"""A run whose trainer waits for data says so in its answer (`input_bound`: the share, the wait against the step, and
that the reads are the bound), and `longrun status` / `watch` show it; a run that does not wait says nothing."""

import json
import re

from rich.console import Console

from longrun.cli import main
from longrun.views import progress_line, run_panel
from server.lifecycle import RunStatus as S
from server.models import Run
from tests.inprocess import App
from trainer import series
from worker.ingest import store_metrics

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def training_lines(steps: int, wait: float, step_time: float) -> str:
    """The trainer's lines for `steps` steps, each waiting `wait` of its `step_time` seconds."""
    return "".join(json.dumps({series.STEP: i, series.TOTAL_STEPS: 100, series.LOSS: 2.0, series.DATA_WAIT_S: wait,
                               series.STEP_TIME_S: step_time, series.INPUT_BOUND: round(wait / step_time, 4)}) + "\n"
                   for i in range(1, steps + 1))


def running_with(cli: App, text: str) -> str:
    run = cli.submit(name="from-disk")
    cli.move(run["id"], S.LAUNCHING, S.RUNNING)
    with cli.session() as s:
        row = s.get(Run, run["id"])
        store_metrics(s, row, row.current, text)
    return run["id"]


def test_a_run_waiting_on_its_reads_says_so_in_its_answer_and_status(cli: App, capsys) -> None:
    # the H200's Llama-8B step from a cold disk: 38.2 ms, of which 10.9 waiting for the batch
    run_id = running_with(cli, training_lines(12, 0.0109, 0.0382))
    answer = cli.client.get(f"/v1/runs/{run_id}").json()
    bound = answer["input_bound"]
    assert bound["share"] == 0.2853 and bound["data_wait_s"] == 0.0109 and bound["step_time_s"] == 0.0382
    assert bound["note"].startswith("input-bound: 29% of each step waits for data (11 of 38 ms); reads are the bound")
    assert "--store-dtype fp8" in bound["note"] and "num_workers" in bound["note"]
    assert "input-bound 29%" in progress_line(answer)

    assert main(["status", run_id]) == 0
    out = " ".join(ANSI.sub("", capsys.readouterr().out).split())
    assert "input-bound: 29% of each step waits for data (11 of 38 ms)" in out
    assert "store the features in FP8" in out


def test_a_run_whose_loader_keeps_up_says_nothing_of_it(cli: App) -> None:
    run_id = running_with(cli, training_lines(12, 0.0004, 0.0273))
    answer = cli.client.get(f"/v1/runs/{run_id}").json()
    assert answer["latest"][series.INPUT_BOUND] < 0.1 and answer["input_bound"] is None
    assert "input-bound" not in progress_line(answer)
    console = Console(width=80, record=True, color_system=None)
    console.print(run_panel(answer, 80))
    assert "input-bound" not in console.export_text()
