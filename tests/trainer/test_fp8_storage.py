"""`prepare --store-dtype fp8`: the features on disk in float8_e4m3fn with a scale per token, half the bytes of
bf16, read back by the loader into the same features (to FP8's precision) and trained on by `trainer.train`."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.trainer.conftest import (
    PREPARED_DRAFT_VOCAB,
    PREPARED_MAX_SAMPLES,
    PREPARED_MAX_SEQ_LEN,
    one_cpu_thread,
)
from tests.trainer.test_train import read_metrics, run
from trainer.data import HiddenStatesDataset, batch_to, list_samples
from trainer.prepare import main as prepare_main

FEATURES = ("hidden_states", "last_hidden_state", "hidden_states_scale", "last_hidden_state_scale")


@pytest.fixture(scope="module")
def prepared_fp8(tiny_verifier: Path, tiny_corpus: Path, tmp_path_factory) -> Path:
    """The same corpus and settings as `prepared_data`, stored in FP8, through the command line."""
    directory = tmp_path_factory.mktemp("prepared_fp8")
    with one_cpu_thread():
        assert prepare_main(["--verifier-path", str(tiny_verifier), "--corpus", str(tiny_corpus), "--output-dir",
                             str(directory), "--max-seq-len", str(PREPARED_MAX_SEQ_LEN), "--draft-vocab-size",
                             str(PREPARED_DRAFT_VOCAB), "--max-samples", str(PREPARED_MAX_SAMPLES), "--batch-size",
                             "8", "--device", "cpu", "--store-dtype", "fp8"]) == 0
    return directory


def feature_bytes_per_token(data_dir: Path) -> float:
    """Bytes of the stored features (and their scales) per token, from the files' headers."""
    total = tokens = 0
    for path in list_samples(data_dir / "hidden_states"):
        with safe_open(path, "pt") as file:
            tokens += file.get_slice("input_ids").get_shape()[0]
            for name in set(FEATURES) & set(file.keys()):
                piece = file.get_slice(name)
                shape, dtype = piece.get_shape(), piece.get_dtype()
                total += torch.Size(shape).numel() * {"BF16": 2, "F8_E4M3": 1, "F32": 4}[dtype]
    return total / tokens


def test_fp8_store_halves_the_bytes_per_token_on_disk(prepared_data: Path, prepared_fp8: Path):
    metadata = json.loads((prepared_fp8 / "prepare.json").read_text())
    assert metadata["dtype"] == "float8_e4m3fn" and metadata["num_samples"] == PREPARED_MAX_SAMPLES
    hidden = metadata["hidden_size"]
    bf16, fp8 = feature_bytes_per_token(prepared_data), feature_bytes_per_token(prepared_fp8)
    assert bf16 == 2 * 4 * hidden  # [3H] + [H] in bf16
    assert fp8 == 4 * hidden + 2 * 4  # the same in one byte each, and two float32 scales
    assert fp8 <= bf16 / 2 + 8
    on_disk = [sum(p.stat().st_size for p in list_samples(d / "hidden_states")) for d in (prepared_data, prepared_fp8)]
    assert on_disk[1] / on_disk[0] < 0.56  # tokens, masks and top ids stay as they are (13 bytes a token)


def test_the_loader_reads_fp8_back_into_the_bf16_features(prepared_data: Path, prepared_fp8: Path):
    files = [list_samples(d / "hidden_states") for d in (prepared_data, prepared_fp8)]
    assert [p.name for p in files[0]] == [p.name for p in files[1]]
    rows = list(range(4))
    bf16, fp8 = (HiddenStatesDataset(None, PREPARED_MAX_SEQ_LEN, files=f).read_batch(rows) for f in files)
    assert fp8["hidden_states"].dtype == torch.float8_e4m3fn and fp8["hidden_states_scale"].shape[-1] == 1
    cpu = torch.device("cpu")
    bf16, fp8 = batch_to(bf16, cpu, torch.float32), batch_to(fp8, cpu, torch.float32)
    assert "hidden_states_scale" not in fp8
    for name in ("input_ids", "loss_mask", "attention_mask", "verifier_top_ids"):
        assert torch.equal(bf16[name], fp8[name]), name
    for name in ("hidden_states", "last_hidden_state"):
        scale = bf16[name].abs().amax(-1, keepdim=True)  # a per-token scale: the error is relative to each token's largest
        error = ((fp8[name] - bf16[name]).abs() / scale.clamp(min=1e-6)).amax()
        assert error <= 1 / 16 + 1e-3, name  # e4m3: 3 mantissa bits


@pytest.mark.slow  # a real trainer.train process
def test_trainer_trains_from_fp8_storage(tiny_verifier: Path, prepared_fp8: Path, tmp_path: Path):
    out = tmp_path / "out"
    result = run([sys.executable, "-m", "trainer.train", "--verifier-path", str(tiny_verifier), "--data-dir",
                  str(prepared_fp8 / "hidden_states"), "--vocab-mapping-dir", str(prepared_fp8 / "vocab_mapping"),
                  "--output-dir", str(out), "--epochs", "2", "--lr", "3e-3", "--max-seq-len", "64", "--num-workers",
                  "2", "--ttt-steps", "3", "--val-ratio", "0.1", "--batch-size", "4"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, validations = read_metrics(out)
    assert steps and validations and all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
