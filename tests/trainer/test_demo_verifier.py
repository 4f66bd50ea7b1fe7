import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.trainer.conftest import TINY_VERIFIER_PRESET, TOKENIZER_SOURCES, one_cpu_thread
from trainer.demo_verifier import STAMP_FILE, build_verifier, main, stdlib_root

HF_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _check_verifier_dir(directory: Path) -> None:
    # imported here, not at collection: transformers' Llama and tokenizers cost a pytest process that never runs
    # these tests some seconds of CPU
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaConfig

    for name in (*HF_FILES, STAMP_FILE, "corpus/train.jsonl", "corpus/heldout.txt"):
        assert (directory / name).is_file(), name
    config = LlamaConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == config.vocab_size and tokenizer.chat_template
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in f.keys()
    train_sources = {json.loads(line)["source"] for line in (directory / "corpus/train.jsonl").open()}
    assert train_sources and (directory / "corpus/heldout.txt").stat().st_size > 0


def test_fixture_verifier_is_a_complete_hf_dir_and_cached(tiny_verifier: Path) -> None:
    _check_verifier_dir(tiny_verifier)
    sources = [stdlib_root() / name for name in TOKENIZER_SOURCES]
    started = time.monotonic()
    summary = build_verifier(tiny_verifier, TINY_VERIFIER_PRESET, source_files=sources)
    assert summary["cached"] and time.monotonic() - started < 2


def test_changed_settings_rebuild(tmp_path: Path) -> None:
    preset = replace(TINY_VERIFIER_PRESET, vocab_size=300, hidden_size=32, intermediate_size=64, steps=2)
    sources = [stdlib_root() / name for name in ("bisect.py", "keyword.py")]
    with one_cpu_thread():
        assert not build_verifier(tmp_path, preset, source_files=sources)["cached"]
        assert build_verifier(tmp_path, preset, source_files=sources)["cached"]
        assert not build_verifier(tmp_path, preset, source_files=sources, steps=3)["cached"]


@pytest.mark.slow
def test_cli_tiny_builds_then_returns_from_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's build in this process (its main: the training is the cost, not another torch import), then the
    command itself as a user runs it, which finds the build and returns."""
    argv = ["--size", "tiny", "--steps", "2", "--output-dir", str(tmp_path)]  # what is built is checked, not how well
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "OMP_WAIT_POLICY"):  # main sets them for its process: put back after
        monkeypatch.delenv(name, raising=False)
    with one_cpu_thread():
        assert main(argv) == 0
    assert "verifier tiny" in capsys.readouterr().out
    _check_verifier_dir(tmp_path)
    started = time.monotonic()
    cached = subprocess.run([sys.executable, "-m", "trainer.demo_verifier", *argv], capture_output=True, text=True,
                            timeout=60, check=True)
    assert "already built" in cached.stdout and time.monotonic() - started < 15
