import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer.conftest import (
    PREPARED_DRAFT_VOCAB,
    PREPARED_MAX_SAMPLES,
    PREPARED_MAX_SEQ_LEN,
    one_cpu_thread,
)
from trainer.corpus import iter_samples, tokenize_chat
from trainer.prepare import main as prepare_main
from trainer.prepare import prepare
from trainer.ttt import verifier_targets
from trainer.verifier_model import capture_hidden_states, default_layer_ids, load_verifier_head
from trainer.vocab import draft_to_target_ids, load_vocab_mapping

REPO = Path(__file__).resolve().parents[2]
CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort a list."},
    {"role": "assistant", "content": "sorted(items)"},
    {"role": "user", "content": "In place?"},
    {"role": "assistant", "content": "items.sort()"},
]
LLAMA3_STYLE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>[{{ message['role'] }}]: {{ message['content'] }}<|endoftext|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>[assistant]: {% endif %}"
)


@pytest.fixture(scope="module")
def verifier(tiny_verifier: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_verifier)


def _samples(prepared: Path) -> list[dict[str, torch.Tensor]]:
    return [
        load_file(str(path)) for path in sorted((prepared / "hidden_states").glob("sample_*.safetensors"))
    ]


def test_files_shapes_and_metadata(prepared_data: Path, tiny_verifier: Path) -> None:
    metadata = json.loads((prepared_data / "prepare.json").read_text())
    hidden = metadata["hidden_size"]
    assert hidden == 64 and metadata["num_samples"] == PREPARED_MAX_SAMPLES
    assert metadata["verifier_path"] == str(tiny_verifier.resolve())
    samples = _samples(prepared_data)
    assert len(samples) == PREPARED_MAX_SAMPLES
    for sample in samples:
        length = sample["input_ids"].shape[0]
        assert 0 < length <= PREPARED_MAX_SEQ_LEN
        assert sample["input_ids"].dtype == torch.int64
        assert sample["loss_mask"].dtype == torch.uint8 and sample["loss_mask"].shape == (length,)
        assert sample["hidden_states"].dtype == torch.bfloat16 and sample["hidden_states"].shape == (
            length,
            3 * hidden,
        )
        assert sample["last_hidden_state"].dtype == torch.bfloat16 and sample["last_hidden_state"].shape == (
            length,
            hidden,
        )
    assert sum(s["input_ids"].numel() for s in samples) == metadata["num_tokens"]
    d2t, t2d = load_vocab_mapping(prepared_data / "vocab_mapping")
    assert d2t.shape == (PREPARED_DRAFT_VOCAB,) and t2d.shape == (metadata["vocab_size"],)
    assert metadata["draft_vocab_size"] == PREPARED_DRAFT_VOCAB
    # The most frequent token of the data is in the draft vocabulary.
    all_ids = torch.cat([s["input_ids"] for s in samples])
    assert bool(t2d[all_ids.bincount().argmax()])


def test_default_layer_ids_are_inputs_of_layers_2_mid_and_n_minus_3(prepared_data: Path, verifier) -> None:
    model, _ = verifier
    assert default_layer_ids(8) == [2, 4, 5] and default_layer_ids(32) == [2, 16, 29]
    assert json.loads((prepared_data / "prepare.json").read_text())["layer_ids"] == [2, 4, 5]
    sample = _samples(prepared_data)[0]
    with torch.no_grad():
        # HF hidden_states[i] is the input of layer i (hidden_states[0] = embeddings).
        reference = model(sample["input_ids"][None], output_hidden_states=True).hidden_states
    expected = torch.cat([reference[2], reference[4], reference[5]], dim=-1)[0]
    torch.testing.assert_close(sample["hidden_states"].float(), expected, atol=0.05, rtol=0.02)


def test_last_hidden_state_is_before_final_norm_and_gives_the_logits(verifier, prepared_data: Path) -> None:
    model, _ = verifier
    input_ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    _, last = capture_hidden_states(model, input_ids, torch.ones_like(input_ids), [2, 4, 5])
    with torch.no_grad():
        output = model(input_ids, output_hidden_states=True)
        logits = model.lm_head(model.model.norm(last))
    torch.testing.assert_close(logits, output.logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(last, model.model.norm(last), atol=1e-2)

    sample = _samples(prepared_data)[0]
    with torch.no_grad():
        stored = model.lm_head(model.model.norm(sample["last_hidden_state"].float()))
        reference = model(sample["input_ids"][None]).logits[0]
    torch.testing.assert_close(stored, reference, atol=0.1, rtol=0.05)
    assert (stored.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


def test_stored_top_ids_are_the_verifiers_top_token_and_the_trainer_takes_its_targets_from_them(
    verifier, tiny_verifier: Path, prepared_data: Path
) -> None:
    """`prepare` stores the verifier's top-1 at every position; the trainer's targets from them (draft rows of
    the head only) are those of the full head."""
    model, _ = verifier
    sample = _samples(prepared_data)[0]
    with torch.no_grad():
        reference = model(sample["input_ids"][None]).logits[0]
    assert sample["verifier_top_ids"].dtype == torch.int32
    assert torch.equal(sample["verifier_top_ids"].long(), reference.argmax(-1))
    _, _, top = capture_hidden_states(model, sample["input_ids"][None], None, [2, 4, 5], top_ids=True, chunk_rows=7)
    assert torch.equal(top[0], reference.argmax(-1))

    head, _ = load_verifier_head(tiny_verifier, *load_vocab_mapping(prepared_data / "vocab_mapping"))
    last, mask = sample["last_hidden_state"][None].float(), sample["loss_mask"][None]
    full = verifier_targets(head, last, mask)
    stored = verifier_targets(head, last, mask, sample["verifier_top_ids"][None])
    assert torch.equal(stored.top, full.top) and torch.equal(stored.valid, full.valid)
    torch.testing.assert_close(stored.probs, full.probs)


def _assistant_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_chat_loss_mask_covers_only_assistant_turns(verifier) -> None:
    _, tokenizer = verifier
    assert tokenizer.chat_template
    ids, mask = tokenize_chat(tokenizer, CONVERSATION, max_seq_len=512)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    assert _assistant_text(tokenizer, ids, mask) == "sorted(items)<|im_end|>\nitems.sort()<|im_end|>\n"
    assert tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m]).count("Sort a list.") == 1


def test_chat_loss_mask_with_fallback_and_other_templates(verifier) -> None:
    _, tokenizer = verifier
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        ids, mask = tokenize_chat(tokenizer, CONVERSATION, max_seq_len=512)
        assert _assistant_text(tokenizer, ids, mask) == "sorted(items)<|im_end|>\nitems.sort()<|im_end|>\n"
        tokenizer.chat_template = LLAMA3_STYLE_TEMPLATE
        ids, mask = tokenize_chat(tokenizer, CONVERSATION, max_seq_len=512)
        # The space after ":" merges into the reply's first token, which is then a target too.
        assert (
            _assistant_text(tokenizer, ids, mask) == " sorted(items)<|endoftext|> items.sort()<|endoftext|>"
        )
    finally:
        tokenizer.chat_template = original
    ids, mask = tokenize_chat(tokenizer, CONVERSATION, max_seq_len=10)
    assert len(ids) == len(mask) == 10


def test_jsonl_corpus_chat_sharegpt_and_text(verifier, tmp_path: Path) -> None:
    _, tokenizer = verifier
    corpus = tmp_path / "mixed.jsonl"
    sharegpt = [{"from": "human", "value": "Sort a list."}, {"from": "gpt", "value": "sorted(items)"}]
    records = [
        {"messages": CONVERSATION},
        {"conversations": sharegpt},
        {"messages": [{"role": "user", "content": "no reply, so no target"}]},
        {"text": "def f(x):\n    return x + 1\n" * 20},
    ]
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    samples = list(iter_samples(tokenizer, corpus, max_seq_len=64))
    assert _assistant_text(tokenizer, *samples[1]) == "sorted(items)<|im_end|>\n"
    text_chunks = samples[2:]
    assert len(text_chunks) >= 2 and all(len(ids) <= 64 and all(mask) for ids, mask in text_chunks)
    assert text_chunks[-1][0][-1] == tokenizer.eos_token_id

    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(iter_samples(tokenizer, tmp_path / "bad.jsonl", max_seq_len=64))


def test_plain_text_is_chunked_without_losing_tokens(verifier, tiny_corpus: Path) -> None:
    _, tokenizer = verifier
    samples = list(iter_samples(tokenizer, tiny_corpus, max_seq_len=64))
    assert all(len(ids) == 64 for ids, _ in samples[:-1]) and len(samples[-1][0]) <= 64
    whole = tokenizer(tiny_corpus.read_text(), add_special_tokens=False).input_ids
    joined = [token for ids, _ in samples for token in ids]
    assert joined == whole[: len(joined)] and len(whole) - len(joined) < 8


def test_chat_corpus_vocab_mapping_counts_only_masked_tokens(tiny_verifier: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    metadata = prepare(
        tiny_verifier, corpus, tmp_path / "out", max_seq_len=128, draft_vocab_size=4, device="cpu"
    )
    sample = load_file(str(tmp_path / "out" / "hidden_states" / "sample_000000.safetensors"))
    masked = set(sample["input_ids"][sample["loss_mask"].bool()].tolist())
    d2t, _ = load_vocab_mapping(tmp_path / "out" / "vocab_mapping")
    assert len(masked) >= 4 and set(draft_to_target_ids(d2t).tolist()) <= masked
    assert metadata["num_samples"] == 1 and metadata["num_loss_tokens"] == int(sample["loss_mask"].sum())


def test_bad_layer_ids_are_refused(tiny_verifier: Path, tiny_corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layer-ids"):
        prepare(tiny_verifier, tiny_corpus, tmp_path, layer_ids=[2, 4, 8], device="cpu")


KILLED_MAX_SAMPLES = 20  # of the corpus's ~390: the kill comes at the 12th sample written, the rest left to resume
KILLED_AT = 12
# trainer.prepare's command line (`python -c KILLED_PREPARE ARGS`), SIGKILLed by itself (as `kill -9` would: no handler,
# no clean-up) the moment its KILLED_AT-th sample file is renamed into place, while its other writer threads may be
# mid-write: a real prepare process killed mid-run at a point that does not depend on the machine's speed (a kill from
# outside, on a count of files polled for every 5 ms, could come after the last sample on a slow or busy machine)
KILLED_PREPARE = f"""
import os, signal, sys, threading
import trainer.prepare as prepare
save, lock, saved = prepare._save_sample, threading.Lock(), []
def save_then_die(path, tensors):
    save(path, tensors)
    with lock:
        saved.append(path)
        if len(saved) == {KILLED_AT}:
            os.kill(os.getpid(), signal.SIGKILL)
prepare._save_sample = save_then_die
sys.exit(prepare.main(sys.argv[1:]))
"""


def _prepare_args(verifier: Path, corpus: Path, out: Path) -> list[str]:
    return ["--verifier-path", str(verifier), "--corpus", str(corpus), "--output-dir", str(out), "--max-seq-len", "32",
            "--batch-size", "1", "--draft-vocab-size", "64", "--max-samples", str(KILLED_MAX_SAMPLES), "--device", "cpu"]


@pytest.mark.slow  # kills a real prepare process
def test_killed_prepare_resumes_skipping_the_samples_written(tiny_verifier: Path, tiny_corpus: Path, tmp_path: Path,
                                                             capsys) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    process = subprocess.run([sys.executable, "-c", KILLED_PREPARE, *_prepare_args(tiny_verifier, tiny_corpus, killed)],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]
    written = sorted((killed / "hidden_states").glob("sample_*.safetensors"))
    assert len(written) >= KILLED_AT and not (killed / "prepare.json").exists()

    # the relaunch reads what the killed process left on disk: in this process (no second torch start-up)
    with one_cpu_thread():
        assert prepare_main(_prepare_args(tiny_verifier, tiny_corpus, killed)) == 0
    metadata = json.loads((killed / "prepare.json").read_text())
    assert metadata["resumed_samples"] == len(written) < metadata["num_samples"] == KILLED_MAX_SAMPLES
    assert f"{len(written)} already written" in capsys.readouterr().out
    assert not list((killed / "hidden_states").glob("*.tmp"))

    with one_cpu_thread():
        clean = prepare(tiny_verifier, tiny_corpus, tmp_path / "clean", max_seq_len=32, draft_vocab_size=64,
                        max_samples=KILLED_MAX_SAMPLES, batch_size=1, device="cpu")
    assert clean["resumed_samples"] == 0 and clean["num_samples"] == metadata["num_samples"]
    for got, want in zip(_samples(killed), _samples(tmp_path / "clean"), strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    for got, want in zip(load_vocab_mapping(killed / "vocab_mapping"), load_vocab_mapping(tmp_path / "clean" / "vocab_mapping"),
                         strict=True):
        assert torch.equal(got, want)


def test_prepare_with_other_settings_starts_over(tiny_verifier: Path, tiny_corpus: Path, tmp_path: Path) -> None:
    with one_cpu_thread():
        prepare(tiny_verifier, tiny_corpus, tmp_path, max_seq_len=32, max_samples=6, draft_vocab_size=64, device="cpu")
        again = prepare(tiny_verifier, tiny_corpus, tmp_path, max_seq_len=32, max_samples=4, draft_vocab_size=64, device="cpu")
        other = prepare(tiny_verifier, tiny_corpus, tmp_path, max_seq_len=24, max_samples=4, draft_vocab_size=64, device="cpu")
    assert again["resumed_samples"] == 4 and other["resumed_samples"] == 0
    assert len(_samples(tmp_path)) == 4 and all(s["input_ids"].numel() <= 24 for s in _samples(tmp_path))


def test_device_auto_spreads_the_verifier_and_writes_the_same_samples(tiny_verifier: Path, tiny_corpus: Path, tmp_path: Path) -> None:
    """Without CUDA, accelerate's device_map="auto" keeps every layer on the CPU, with one GPU on it; with two or more, the layers
    are spread over them (each layer's device is in prepare.json) and the features match the CPU's to bf16."""
    with one_cpu_thread():
        cpu = prepare(tiny_verifier, tiny_corpus, tmp_path / "cpu", max_seq_len=32, max_samples=4, draft_vocab_size=64,
                      device="cpu")
        auto = prepare(tiny_verifier, tiny_corpus, tmp_path / "auto", max_seq_len=32, max_samples=4, draft_vocab_size=64,
                       device="auto")
    assert len(auto["layer_devices"]) == cpu["num_hidden_layers"] == 8
    if torch.cuda.device_count() >= 2:
        assert len(set(auto["layer_devices"])) >= 2
    elif torch.cuda.is_available():
        assert set(auto["layer_devices"]) == {"cuda:0"}
    else:
        assert set(auto["layer_devices"]) == set(cpu["layer_devices"]) == {"cpu"}
    for got, want in zip(_samples(tmp_path / "auto"), _samples(tmp_path / "cpu"), strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"])
        for name in ("hidden_states", "last_hidden_state"):
            similarity = torch.nn.functional.cosine_similarity(got[name].float(), want[name].float(), dim=-1)
            assert float(similarity.min()) > 0.99, name  # bf16 on GPUs against fp32 on the CPU


def test_a_long_prepare_reports_how_far_it_is_and_its_eta(tiny_verifier: Path, tiny_corpus: Path, tmp_path: Path,
                                                          capsys, monkeypatch) -> None:
    import trainer.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "REPORT_SECONDS", 0)
    corpus = tmp_path / "corpus.jsonl"  # records read one by one (plain text is read a large piece ahead)
    paragraphs = [p for p in tiny_corpus.read_text().split("\n\n") if p.strip()][:40]
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    with one_cpu_thread():
        prepare(tiny_verifier, corpus, tmp_path / "out", max_seq_len=32, draft_vocab_size=64, batch_size=2,
                device="cpu")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prepare:")]
    assert len(lines) >= 3
    done = [float(re.search(r"; ([\d.]+)% done after", line).group(1)) for line in lines]
    assert done == sorted(done) and 0 < done[0] < done[-1] <= 100
    assert all(re.search(r"ETA (\d+s|\d+m \d\ds|\d+h \d\dm)$", line) for line in lines if "100.0%" not in line)
