"""The watch view fits an 80-column terminal at any TTT depth and GPU count, state and ETA always in sight."""

import re
import threading
from io import StringIO
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from longrun.cli import main
from longrun.client import Client
from longrun.views import progress_line, run_panel, runs_table
from server.lifecycle import RunStatus as S
from server.models import Run
from tests.inprocess import App

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def latest(ttt: int, gpus: int, nodes: int = 1) -> dict[str, Any]:
    values: dict[str, Any] = {"step": 4520, "total_steps": 10000, "epoch": 1.23, "loss": 1.2345, "val_loss": 1.3456,
                              "tokens_per_s": 123456.0, "ttt_steps": ttt}
    for k in range(ttt):
        values[f"acc_{k}"] = 0.9 * 0.97 ** k
        values[f"val_acc_{k}"] = 0.88 * 0.97 ** k
        values[f"cond_acc_{k}"] = 0.95
        values[f"loss_{k}"] = 1.1
    for node in range(nodes):
        prefix = f"node{node}_" if node else ""
        for g in range(gpus):
            values[f"{prefix}gpu_util_{g}"] = 100.0 if g == 0 else 97.0
            values[f"{prefix}gpu_mem_{g}"] = 143_771.0
    return values


def a_run(ttt: int, gpus: int, nodes: int = 1, status: str = "running") -> dict[str, Any]:
    return {"id": "0123456789ab", "name": f"k2-eagle3-ttt{ttt}-with-a-rather-long-name-for-a-run",
            "status": status, "attempt": 2, "progress": 0.452, "eta_seconds": 5025.0, "message": None,
            "spec": {"trainer": {"ttt_steps": ttt}}, "latest": latest(ttt, gpus, nodes),
            "attempts": [{"number": 2, "seconds_per_step": 0.81}]}


def rendered(renderable: Any, width: int = 80) -> list[str]:
    console = Console(width=width, file=StringIO(), color_system=None, record=True)
    console.print(renderable)
    return console.export_text().splitlines()


@pytest.mark.parametrize(("ttt", "gpus", "nodes"), [(16, 8, 1), (1, 1, 1), (5, 8, 1), (64, 8, 2)])
def test_the_panel_fits_80_columns_with_state_eta_every_acc_and_every_gpu(ttt: int, gpus: int, nodes: int) -> None:
    lines = rendered(run_panel(a_run(ttt, gpus, nodes), 80))
    assert max(cell_len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    head = lines[1]
    assert "running" in head and "attempt 2" in head and "ETA 1h 23m" in head and f"TTT {ttt}" in head
    # step 0's loss, which compares across depths, not the sum over TTT steps (`loss`)
    assert "45.2%" in text and "step 4520/10000" in text and "loss_0 1.1000" in text and "1.2345" not in text
    accs = re.findall(r"(\d+) (0\.\d\d)", text.split("acc_k", 1)[1].split("val_acc", 1)[0])
    assert [int(k) for k, _ in accs] == list(range(ttt))
    gpu_cells = re.findall(r"(n\d+:)?(\d+) +(\d+)% +140\.4G", text)
    assert len(gpu_cells) == gpus * nodes


def test_an_8_gpu_ttt_16_run_wraps_into_rows_not_off_the_screen() -> None:
    lines = rendered(run_panel(a_run(16, 8), 80))
    acc_rows = [line for line in lines if re.search(r"\b0\.\d\d\b", line) and "gpu" not in line]
    gpu_rows = [line for line in lines if "140.4G" in line]
    assert len(acc_rows) >= 4  # acc_k and val_acc in two rows each
    assert len(gpu_rows) == 2
    assert len(lines) <= 14
    # the one-line form for logs: state and ETA first, the accuracies cut short, the GPUs as their mean
    line = progress_line(a_run(16, 8))
    assert line.startswith("running (attempt 2) | ETA 1h 23m | 45.2%")
    assert len(progress_line(a_run(64, 8, nodes=2))) - len(line) <= 1  # "x16": it does not grow with depth or GPUs
    assert "acc 0.90/0.87/0.85/0.82/../0.57 (16 steps)" in line and "gpu 97% x8" in line


def test_watch_on_an_80_column_terminal_draws_the_panel_within_it(cli: App, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "80")
    run = cli.submit(name="ttt16-eight-gpus")
    cli.move(run["id"], S.LAUNCHING, S.RUNNING)
    with cli.session() as s:
        s.get(Run, run["id"]).latest = latest(16, 8)

    # the run ends once watch has drawn it running (a wait on that, not on the clock: a loaded machine's first
    # frame can come later than any fixed sleep)
    drawn = threading.Event()
    watch_of = Client.watch

    def watching(self, *args, **kwargs):
        for snapshot in watch_of(self, *args, **kwargs):
            yield snapshot
            drawn.set()

    monkeypatch.setattr(Client, "watch", watching)

    def finish() -> None:
        drawn.wait(timeout=60)
        cli.move(run["id"], S.SUCCEEDED)

    mover = threading.Thread(target=finish)
    mover.start()
    assert main(["watch", run["id"], "--interval", "0.1"]) == 0
    mover.join()
    out = ANSI.sub("", capsys.readouterr().out)
    lines = [line for line in out.replace("\r", "\n").splitlines() if line.strip()]
    assert max(cell_len(line) for line in lines) <= 80
    assert any("running  attempt 1  ETA" in line for line in lines)
    assert any("succeeded  attempt 1" in line for line in lines)
    assert "ttt16-eight-gpus" in out and " 15 0.57" in out and "7  97%" in out


@pytest.mark.parametrize("run_id", ["abcdef012345", "f00", "deadbeef"])
def test_an_id_that_reads_like_a_colour_stays_in_the_title(run_id: str) -> None:
    run = {**a_run(2, 1), "id": run_id, "name": "toy [/x] [bold]run"}
    assert f"toy [/x] [bold]run [{run_id}]" in rendered(run_panel(run, 80))[0]


def test_the_runs_table_and_the_progress_line_show_step_0s_loss_comparable_across_depths() -> None:
    shallow, deep = a_run(3, 1), a_run(5, 1)
    shallow["latest"].update(loss=10.73, loss_0=2.31)
    deep["latest"].update(loss=14.78, loss_0=2.29)  # a deeper restart that trains better, though its sum is higher
    table = "\n".join(rendered(runs_table([shallow, deep]), 160))
    assert "LOSS (TTT 0)" in table and "2.3100" in table and "2.2900" in table and "14.78" not in table
    assert "loss_0 2.2900" in progress_line(deep) and "val_loss 1.3456" in progress_line(deep)
    own = {**a_run(1, 1), "latest": {"loss": 0.5}}  # a trainer that logs one loss: that one
    assert "loss 0.5000" in progress_line(own) and "0.5000" in "\n".join(rendered(runs_table([own]), 160))
