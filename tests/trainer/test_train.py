"""`python -m trainer.train` end to end on a tiny local verifier: DDP under torchrun, metrics,
checkpoints, exact resume, SIGTERM / SIGKILL and relaunch, --no-resume, --init-from."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import _built_once
from tests.trainer.tiny_setup import build_dataset, build_verifier
from trainer.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[2]
TTT_STEPS = 3


def shared_across_workers(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], dict]) -> dict:
    """`make(directory)` once for the whole pytest run, its xdist workers included (`_built_once`), and its (JSON)
    result. (`--dist loadgroup` does not keep an xdist_group in one worker with pytest 9.2 and xdist 3.8,
    pytest-xdist#1386: xdist renames the node ids to group them through an attribute pytest 9.2 no longer reads, so
    a module-scoped fixture alone would be made once per worker that takes one of its tests.)"""
    directory = _built_once(factory, name, lambda d: (d / "result.json").write_text(json.dumps(make(d))))
    return json.loads((directory / "result.json").read_text())


def build_tiny(root: Path) -> dict[str, str]:
    verifier = build_verifier(root / "verifier")
    build_dataset(verifier, root / "data", samples=48)
    return {"verifier": str(root / "verifier"), "data": str(root / "data" / "hidden_states"),
            "vocab": str(root / "data" / "vocab_mapping")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny verifier and its features, built once for the pytest run (all its xdist workers); only read."""
    return {k: Path(v) for k, v in shared_across_workers(tmp_path_factory, "train-tiny", build_tiny).items()}


def train_command(tiny, output_dir, nproc=1, **flags) -> list[str]:
    """The production flag set (docs/trainer.md, README), with values small enough for two CPU cores."""
    values = {
        "verifier-path": tiny["verifier"], "data-dir": tiny["data"], "vocab-mapping-dir": tiny["vocab"],
        "output-dir": output_dir, "epochs": 4, "lr": 3e-3, "max-seq-len": 48, "num-workers": 0,
        "ttt-steps": TTT_STEPS, "noise-std": 0.05, "scheduler": "cosine", "warmup-ratio": 0.05, "val-ratio": 0.1,
    }
    values.update({k.replace("_", "-"): v for k, v in flags.items()})
    args = []
    for name, value in values.items():
        if value is True:
            args.append(f"--{name}")
        elif value is not None:
            args += [f"--{name}", str(value)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    return [*launcher, "-m", "trainer.train", *args]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "LONGRUN_METRICS_FILE"}
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(REPO)
    return e


def run(command, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def read_metrics(output_dir: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "loss" in x], [x for x in lines if "val_loss" in x]


@pytest.mark.slow
def test_torchrun_two_ranks_trains_reports_and_exports(tiny, tmp_path):
    out = tmp_path / "out"
    result = run(train_command(tiny, out, nproc=2, num_workers=1, epochs=5))
    assert result.returncode == 0, result.stderr[-3000:]
    train, val = read_metrics(out)
    total = train[0]["total_steps"]
    assert [x["step"] for x in train] == list(range(1, total + 1))  # rank 0 alone writes, once per step
    for record in train:
        assert record["ttt_steps"] == TTT_STEPS
        for name in ("loss", "acc", "cond_acc"):
            assert [k for k in record if k.startswith(name + "_")] == [f"{name}_{k}" for k in range(TTT_STEPS)]
        assert {"epoch", "time", "lr", "grad_norm", "tokens_per_s"} <= record.keys()
        assert all(0 <= record[f"acc_{k}"] <= 1 for k in range(TTT_STEPS))
    first, last = train[:20], train[-20:]
    assert sum(x["loss"] for x in last) < 0.8 * sum(x["loss"] for x in first)
    assert total >= 100 and len(val) == 5 and val[-1]["step"] == total
    assert val[-1]["val_acc_0"] > val[0]["val_acc_0"] or val[-1]["val_loss"] < val[0]["val_loss"]
    config = json.loads((out / "config.json").read_text())
    assert config["ttt_steps"] == TTT_STEPS and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (out / "model.safetensors").is_file()
    assert latest_checkpoint(out).name == f"step_{total:08d}"
    # where rank 0's start-up went, said once
    startup = [line for line in result.stdout.splitlines() if line.startswith("startup:")]
    assert len(startup) == 1, result.stdout[-2000:]
    assert re.fullmatch(r"startup: [\d.]+ s to the end of step 1 \(python and imports [\d.]+ s, setup [\d.]+ s, "
                        r"model [\d.]+ s, data [\d.]+ s, first batch [\d.]+ s, first step [\d.]+ s\)",
                        startup[0]), startup[0]


def wait_for(predicate, process, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            pytest.fail(f"the run ended (rc {process.returncode}) before the awaited moment: {process.stdout.read()[-2000:]}")
        time.sleep(0.02)
    pytest.fail("timed out")


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun's workers start sessions of their own, so a process
    group does not reach them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def checkpoint_step(out: Path) -> int:
    latest = latest_checkpoint(out)
    return int(latest.name.removeprefix("step_")) if latest else 0


# One two-rank torchrun run serves both stop tests (a torchrun launch costs about 10 CPU-s of imports before its first
# step): it is stopped as a cancel stops a run (stop_a_run), and then relaunched, SIGKILLed and relaunched again. Both
# tests take it through the stopped_run fixture (one run for the pytest run, whichever xdist workers they land in);
# their group keeps them in one worker where xdist's grouping works.
STOPPED_RUN = pytest.mark.xdist_group("torchrun_stopped_run")


def launch(command) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def metrics_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def stop_a_run(tiny, out: Path) -> dict:
    """Start a two-rank torchrun run with data-loader threads and stop it once it has a checkpoint (step 15 or
    later) as a cancel stops a run: SIGTERM to every process of it (torchrun, which forwards it, and both ranks).
    Returns what the stop left, as it happened."""
    command = train_command(tiny, out, nproc=2, num_workers=2, epochs=4, save_every=15, scheduler="constant")
    first = launch(command)
    try:
        wait_for(lambda: checkpoint_step(out) >= 15, first)
        lines = metrics_lines(out)
        tree = process_tree(first.pid)
        signalled = time.time()
        for pid in tree:
            os.kill(pid, signal.SIGTERM)
        output = first.communicate(timeout=60)[0]
        seconds = time.time() - signalled
        survivors = [pid for pid in tree if Path(f"/proc/{pid}").exists()]
    finally:
        if first.poll() is None:  # it failed mid-way: leave nothing running
            for pid in process_tree(first.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            first.communicate()
    return {"out": str(out), "command": command, "tree": tree, "lines_before": lines, "seconds": seconds,
            "output": output, "returncode": first.returncode, "survivors": survivors,
            "checkpoint": checkpoint_step(out)}


@pytest.fixture(scope="module")
def stopped_run(tiny, tmp_path_factory) -> dict:
    """stop_a_run's run, once for the pytest run: test_sigterm_to_every_process_stops_both_ranks_at_a_step reads what
    its stop left, test_killed_torchrun_run_resumes_at_its_checkpoint relaunches it from its output dir."""
    return shared_across_workers(tmp_path_factory, "train-stopped-run",
                                 lambda directory: stop_a_run(tiny, directory / "out"))


@pytest.mark.slow
@STOPPED_RUN
def test_killed_torchrun_run_resumes_at_its_checkpoint(stopped_run):
    out, command = Path(stopped_run["out"]), stopped_run["command"]

    # SIGTERM (the cancel's, to torchrun, which forwards it, and to the ranks): the workers stop after their current
    # step, non-zero exit.
    assert stopped_run["returncode"] != 0
    assert "stopping at step" in stopped_run["output"]
    resume_1 = stopped_run["checkpoint"]

    # SIGKILL to every process of the run, workers included: no chance to clean up.
    second = launch(command)
    wait_for(lambda: checkpoint_step(out) >= resume_1 + 30, second)
    tree = process_tree(second.pid)
    for pid in tree:
        os.kill(pid, signal.SIGKILL)
    second_output = second.communicate(timeout=30)[0]
    resume_2 = checkpoint_step(out)
    assert f"at step {resume_1} " in second_output

    third = launch(command)
    output = third.communicate(timeout=180)[0]
    assert third.returncode == 0, output[-3000:]
    assert f"at step {resume_2} " in output

    train, _ = read_metrics(out)
    steps = [x["step"] for x in train]
    assert steps[0] == 1 and steps[-1] == train[-1]["total_steps"]
    for previous, step in zip(steps, steps[1:], strict=False):
        # a line is either the next step, or the first step after a checkpoint (a relaunch)
        assert step == previous + 1 or step in (resume_1 + 1, resume_2 + 1), (previous, step)


def test_resume_continues_exactly_where_the_checkpoint_left_off(tiny, tmp_path, in_process, capsys):
    # A constant schedule keeps the lr independent of --max-steps, so a run stopped at step 12 and
    # continued to 24 must match an uninterrupted 24-step run step for step.
    flags = dict(scheduler="constant", warmup_ratio=0, epochs=2)
    assert in_process(train_command(tiny, tmp_path / "whole", max_steps=24, **flags)) == 0
    assert in_process(train_command(tiny, tmp_path / "split", max_steps=12, **flags)) == 0
    capsys.readouterr()
    assert in_process(train_command(tiny, tmp_path / "split", max_steps=24, **flags)) == 0
    assert "at step 12 " in capsys.readouterr().out

    expected, _ = read_metrics(tmp_path / "whole")
    got, _ = read_metrics(tmp_path / "split")
    assert [x["step"] for x in got] == list(range(1, 25))
    for a, b in zip(expected, got, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]

    with pytest.raises(SystemExit, match="--no-resume"):
        in_process(train_command(tiny, tmp_path / "split", max_steps=24, no_resume=True, **flags))


def test_init_from_loads_weights_but_starts_a_new_run(tiny, tmp_path, in_process):
    trained, warm = tmp_path / "trained", tmp_path / "warm"
    assert in_process(train_command(tiny, trained, max_steps=60, epochs=3)) == 0
    assert in_process(train_command(tiny, warm, max_steps=2, ttt_steps=5, init_from=trained)) == 0
    fresh_metrics, _ = read_metrics(trained)  # its first step is a fresh draft's (same seed, same data)
    warm_metrics, _ = read_metrics(warm)
    assert warm_metrics[0]["step"] == 1 and warm_metrics[0]["ttt_steps"] == 5
    assert [k for k in warm_metrics[0] if k.startswith("acc_")] == [f"acc_{k}" for k in range(5)]
    assert warm_metrics[0]["loss_0"] < fresh_metrics[0]["loss_0"] - 0.3


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
def test_prefetch_delivers_every_batch_in_order_cast_to_the_training_dtype(device):
    from trainer.data import prefetch_to_device

    batches = [{"input_ids": torch.full((1, 8), i), "hidden_states": torch.randn(1, 8, 12),
                "last_hidden_state": torch.randn(1, 8, 4)} for i in range(5)]
    got = list(prefetch_to_device(iter(batches), torch.device(device), torch.bfloat16))
    assert [int(b["input_ids"][0, 0]) for b in got] == [0, 1, 2, 3, 4]
    for sent, received in zip(batches, got, strict=True):
        assert received["hidden_states"].dtype == torch.bfloat16 and received["hidden_states"].device.type == device
        assert torch.equal(received["hidden_states"].cpu(), sent["hidden_states"].to(torch.bfloat16))
        assert received["input_ids"].dtype == torch.long
    assert list(prefetch_to_device(iter([]), torch.device(device), torch.bfloat16)) == []


@pytest.mark.slow
@STOPPED_RUN
def test_sigterm_to_every_process_stops_both_ranks_at_a_step(stopped_run):
    # What a cancel does: SIGTERM to every process carrying the run's token. Each rank gets it twice, from
    # here and forwarded by torchrun, while its reader threads are busy; a rank leaving mid-step would leave
    # the other waiting in an all-reduce. (stopped_run: the run, and what its stop left.)
    assert stopped_run["lines_before"] >= 5  # it was training when stopped
    assert len(stopped_run["tree"]) >= 3, stopped_run["tree"]  # torchrun and 2 ranks
    assert stopped_run["seconds"] < 10, "a cancel would have had to SIGKILL it"
    assert "stopping at step" in stopped_run["output"], stopped_run["output"][-3000:]
    assert not stopped_run["survivors"]


def test_throughput_is_tokens_over_the_last_steps_time():
    from trainer.metrics import Throughput

    clock = iter([100.0, 101.0, 101.1, 103.0, 104.0, 104.5])
    rate = Throughput(window=2, clock=lambda: next(clock))  # starts at t=100
    assert rate.add(1000) == pytest.approx(1000 / 1.0)
    assert rate.add(1000) == pytest.approx(2000 / 1.1)  # a step read late next to its predecessor: no spike
    assert rate.add(1000) == pytest.approx(2000 / 2.0)  # window of 2: from t=101
    rate.reset()  # t=104: validation and a checkpoint are not counted
    assert rate.add(500) == pytest.approx(500 / 0.5)


def test_profile_window_writes_a_trace_and_a_per_step_summary(tiny, tmp_path, in_process, monkeypatch):
    monkeypatch.setenv("LONGRUN_PROFILE_DIR", str(tmp_path / "profile"))
    monkeypatch.setenv("LONGRUN_PROFILE_STEPS", "2:3")
    assert in_process(train_command(tiny, tmp_path / "out", max_steps=12)) == 0
    summary = (tmp_path / "profile" / "summary.txt").read_text()
    assert summary.startswith("steps recorded: 3;") and "aten::" in summary
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    assert any(event.get("name", "").startswith("aten::mm") for event in trace["traceEvents"])


def test_device_busy_time_counts_work_on_several_streams_once():
    from trainer.profiling import device_busy_seconds

    def event(cat, ts, dur):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        event("kernel", 0, 100), event("gpu_memcpy", 50, 100),  # a copy on a side stream overlaps: 0-150
        event("kernel", 200, 10), event("gpu_memset", 205, 2),  # 200-210
        event("cpu_op", 0, 1000), event("gpu_user_annotation", 0, 1000),  # not device work
    ]}
    assert device_busy_seconds(trace) == pytest.approx(160e-6)


@pytest.mark.slow  # a real torchrun run
def test_torchrun_packs_samples_and_accumulates_to_the_global_batch(tiny, tmp_path):
    from trainer.data import HiddenStatesDataset, PackedBatchSampler, split_files

    out = tmp_path / "out"
    # samples are 48 tokens: two per 100-token row; 2 ranks x 1 row x 2 micro-batches = 4 rows per step
    result = run(train_command(tiny, out, nproc=2, epochs=2, max_seq_len=100, pack_samples=True, global_batch_size=4))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 packed rows per step (2 micro-batches of 1 per rank)" in result.stdout
    train_files, _ = split_files(tiny["data"], 0.1, 0)
    lengths = HiddenStatesDataset(None, 100, files=train_files).lengths()
    rows = [PackedBatchSampler(lengths, 100, 1, seed=0, world_size=2).batches_in_epoch(e) for e in (0, 1)]
    assert rows[0] == -(-len(train_files) // 2 // 2)  # every row holds two samples
    train, val = read_metrics(out)
    assert [x["step"] for x in train] == list(range(1, sum(-(-r // 2) for r in rows) + 1))
    assert len(val) == 2 and all(x["tokens_per_s"] > 0 for x in train)
    assert latest_checkpoint(out).name == f"step_{len(train):08d}"
