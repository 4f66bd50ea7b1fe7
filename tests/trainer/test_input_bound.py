"""Whether the disk keeps up: the trainer's wait for data on each metrics line (`data_wait_s`, `input_bound`), and the
loader sizing its readers from the read rate it measures when the user gave no --num-workers."""

import json
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_setup import build_dataset, build_verifier
from trainer import series
from trainer.data import BatchLoader, HiddenStatesDataset, ReaderSizing, ShardBatchSampler
from trainer.metrics import InputWait, StepStart, progress_line
from trainer.prepare import expected_tokens_per_s, storage_note
from trainer.train import main as train_main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        verifier = build_verifier(root / "verifier")
        build_dataset(verifier, root / "data", samples=16)
    finally:
        torch.set_num_threads(threads)
    return {"verifier": root / "verifier", "data": root / "data" / "hidden_states", "vocab": root / "data" / "vocab_mapping"}


@pytest.fixture
def train(tiny, monkeypatch):
    """trainer.train.main in this process on one thread, for a few steps: the training lines it wrote."""
    monkeypatch.delenv("LONGRUN_METRICS_FILE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def run(output: Path, *flags: str, steps: int = 12) -> list[dict]:
        argv = ["--verifier-path", str(tiny["verifier"]), "--data-dir", str(tiny["data"]), "--vocab-mapping-dir",
                str(tiny["vocab"]), "--output-dir", str(output), "--max-seq-len", "48", "--ttt-steps", "2",
                "--val-ratio", "0", "--sim-depth", "0", "--max-steps", str(steps), "--epochs", "2", "--lr", "1e-3", *flags]
        assert train_main(argv) == 0
        lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
        return [line for line in lines if series.LOSS in line]

    yield run
    torch.set_num_threads(threads)


def slow_reads(monkeypatch, seconds: float) -> None:
    """Every batch read takes `seconds` more (a slow disk; sleeping releases the GIL as a read does)."""
    read = HiddenStatesDataset._read_rows

    def slow(self, rows, pin):
        time.sleep(seconds)
        return read(self, rows, pin)

    monkeypatch.setattr(HiddenStatesDataset, "_read_rows", slow)


def test_a_loader_slower_than_the_step_shows_the_step_waiting_for_data(train, tmp_path, monkeypatch, capsys):
    slow_reads(monkeypatch, 0.25)
    lines = train(tmp_path / "slow", "--num-workers", "0")
    for line in lines:
        assert 0 <= line[series.DATA_WAIT_S] <= line[series.STEP_TIME_S]
    last = lines[-1]
    assert last[series.DATA_WAIT_S] >= 0.2
    assert last[series.INPUT_BOUND] > 0.5, last
    assert "input-bound" in capsys.readouterr().out  # the progress line says it too


def test_a_loader_ahead_of_the_step_shows_no_wait(train, tmp_path, monkeypatch):
    # each step 0.1 s longer (sleeping, as a GPU step leaves the host free): the readers are ahead by construction,
    # not by this machine's speed (at load on 2 cores, two reader threads against the step's own work once came to
    # 20.1% waiting)
    class SlowStart(StepStart):
        def __init__(self, device: torch.device) -> None:
            super().__init__(device)
            time.sleep(0.1)

    monkeypatch.setattr("trainer.train.StepStart", SlowStart)
    lines = train(tmp_path / "fast", "--num-workers", "2")
    last = lines[-1]
    assert last[series.INPUT_BOUND] < 0.2, last
    assert last[series.STEP_TIME_S] > 0


def test_the_progress_line_names_the_wait_only_when_it_matters():
    record = {series.STEP: 10, series.TOTAL_STEPS: 100, series.EPOCH: 0.1, series.LOSS: 1.0, series.TTT_STEPS: 1,
              "acc_0": 0.5, series.LR: 1e-4, series.GRAD_NORM: 1.0, series.TOKENS_PER_S: 1000.0,
              series.DATA_WAIT_S: 0.011, series.STEP_TIME_S: 0.038, series.INPUT_BOUND: 0.29}
    assert "input-bound 29% (11 of 38 ms waiting for data)" in progress_line(record, 60)
    assert "input-bound" not in progress_line({**record, series.INPUT_BOUND: 0.02}, 60)


def test_the_share_is_over_the_last_steps_and_starts_over_after_a_pause():
    waits = InputWait(window=2)
    assert waits.share(0.5, 1.0) == 0.5
    assert waits.share(0.0, 1.0) == 0.25
    assert waits.share(0.0, 1.0) == 0.0  # the first step has left the window
    waits.reset()
    assert waits.share(0.3, 0.4) == pytest.approx(0.75)


def loader(tiny, workers: int, sizing: ReaderSizing | None) -> BatchLoader:
    dataset = HiddenStatesDataset(tiny["data"], 48)
    return BatchLoader(dataset, ShardBatchSampler(len(dataset), 1, shuffle=False), workers, 4 * workers, pin=False,
                       sizing=sizing)


def consume(batches: BatchLoader, seconds: float) -> list[int]:
    """Iterate an epoch as a training loop taking `seconds` per batch does; the first token of each batch."""
    seen = []
    for batch in batches:
        seen.append(int(batch["input_ids"][0, 0]))
        time.sleep(seconds)
    return seen


def test_readers_too_slow_for_the_step_are_raised_and_the_line_says_why(tiny, monkeypatch):
    slow_reads(monkeypatch, 0.08)  # one reader gives a batch per 80 ms; training takes one per 10 ms
    said = []
    sizing = ReaderSizing(max_readers=6, skip=1, probe=4, log=said.append)
    batches = loader(tiny, 1, sizing)
    in_order = consume(loader(tiny, 0, None), 0)
    assert consume(batches, 0.01) == in_order  # every batch, in order, whatever the readers
    assert batches.num_workers == 6 and batches.read_ahead >= 6
    assert said and said[0].startswith("readers: 1 -> 6 (the cap), read-ahead 4 -> ")
    assert "ms to train" in said[0] and "GB/s needed" in said[0] and "--num-workers" in said[0]


def test_readers_that_keep_up_are_left_as_they_are(tiny):
    said = []
    batches = loader(tiny, 2, ReaderSizing(skip=1, probe=4, log=said.append))
    consume(batches, 0.02)
    assert batches.num_workers == 2 and batches.read_ahead == 8
    assert len(said) == 1 and "are enough" in said[0]


def test_read_ahead_stays_within_its_memory_cap(tiny, monkeypatch):
    slow_reads(monkeypatch, 0.08)
    dataset = HiddenStatesDataset(tiny["data"], 48)
    one_batch = sum(v.numel() * v.element_size() for v in dataset.read_batch([0]).values())
    sizing = ReaderSizing(max_readers=8, max_read_ahead_bytes=5 * one_batch, skip=1, probe=4, log=lambda line: None)
    batches = loader(tiny, 1, sizing)
    consume(batches, 0.005)
    assert batches.num_workers > 1
    assert batches.read_ahead * one_batch <= 5 * one_batch


def test_an_explicit_num_workers_is_the_users_and_unset_one_is_sized(train, tmp_path, capsys):
    train(tmp_path / "explicit", "--num-workers", "2")
    assert "readers:" not in capsys.readouterr().out
    train(tmp_path / "sized", steps=32)  # past the compile's steps and the probe's (ReaderSizing.skip, .probe)
    assert "readers: " in capsys.readouterr().out


def llama_8b_sample(directory: Path, tokens: int = 64) -> Path:
    """A sample file as `prepare` writes it for a 4096-wide verifier, in bf16."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": torch.zeros(tokens, dtype=torch.long), "loss_mask": torch.ones(tokens, dtype=torch.uint8),
               "hidden_states": torch.zeros(tokens, 3 * 4096, dtype=torch.bfloat16),
               "last_hidden_state": torch.zeros(tokens, 4096, dtype=torch.bfloat16)},
              str(directory / "sample_000000.safetensors"))
    return directory


def test_prepare_says_fp8_halves_the_bytes_where_the_disk_is_the_bound(tmp_path):
    samples = llama_8b_sample(tmp_path / "hidden_states")
    # the H200 machine's disk: 1.73 GB/s cold, 52.7k tokens/s of bf16 features; one H200 trains about 75k
    note = storage_note(samples, 4096, "bf16", 1, read_rate=(1.73e9, True))
    assert note.startswith("prepare: reads will bound training: bf16 samples are 32.8 KB a token")
    assert "1.73 GB/s cold" in note and "75.0k tokens/s" in note and "2.46 GB/s" in note
    assert "--store-dtype fp8 halves the feature bytes (16.4 KB a token, 105.4k tokens/s from this disk)" in note
    assert storage_note(samples, 4096, "bf16", 1, read_rate=(3e9, True)) is None  # this disk keeps up
    assert storage_note(samples, 4096, "fp8", 1, read_rate=(1.73e9, True)) is None  # FP8 already
    # measured here: the file flushed, dropped from the cache and read back, against a rate no disk gives
    measured = storage_note(samples, 4096, "bf16", 1, train_tokens_per_s=1e12)
    assert "GB/s" in measured and "(1 file, 4 readers)" in measured


def test_the_expected_training_rate_follows_the_measured_steps():
    assert expected_tokens_per_s(4096, 1) == 75_000
    assert expected_tokens_per_s(7168, 1) == pytest.approx(36_500, rel=0.02)  # Kimi-K2's 56.1 ms a 2048-token step
    assert expected_tokens_per_s(4096, 8) == 600_000
    assert expected_tokens_per_s(64, 1) is None  # too small a draft for the rule


def test_each_step_line_splits_its_time_into_a_fixed_part_and_one_ttt_iteration(train, tmp_path):
    # on the CPU nothing compiles: every step runs as the rest of the run will, and is timed
    lines = train(tmp_path / "timed", "--num-workers", "0")
    for line in lines:
        iteration, fixed = line["ttt_iter_s"], line["step_fixed_s"]
        assert iteration > 0 and fixed >= 0
        assert fixed + 2 * iteration == pytest.approx(max(line[series.STEP_TIME_S], 2 * iteration), abs=2e-6)
