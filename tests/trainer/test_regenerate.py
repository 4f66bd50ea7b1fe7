"""`prepare --regenerate`: responses rewritten by the tiny verifier itself, batched, resumable."""

import json

import pytest
import torch

from tests.trainer.conftest import one_cpu_thread
from trainer.corpus import FALLBACK_CHAT_TEMPLATE, adds_bos, tokenize_text_stream
from trainer.prepare import main as prepare_main
from trainer.regenerate import REGENERATED_FILE, regenerate_corpus
from trainer.verifier_model import load_verifier

SEQ = 32


@pytest.fixture(scope="module")
def verifier(tiny_verifier):
    with one_cpu_thread():
        yield load_verifier(tiny_verifier, torch.device("cpu"), torch.float32)


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """Plain greedy decoding: a full forward pass per token, no cache, no padding."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if token in stop:
            break
        ids.append(token)
    return ids[len(prompt) :]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_regeneration_is_the_verifiers_own_continuation(verifier, tiny_verifier, tiny_corpus, tmp_path):
    model, tokenizer = verifier
    with one_cpu_thread():
        path = regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path, SEQ, max_samples=4, batch_size=4,
                                 devices=["cpu"])
        regenerated = records(path)
        assert [r["index"] for r in regenerated] == [0, 1, 2, 3]
        bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
        chunks = [ids for ids, _ in tokenize_text_stream(tokenizer, tiny_corpus, SEQ, bos)][:4]
        for record, chunk in zip(regenerated, chunks, strict=True):
            prompt = chunk[: SEQ // 2]
            continuation = greedy_reference(model, prompt, SEQ - len(prompt) - 1, {tokenizer.eos_token_id})
            assert continuation, "the verifier wrote nothing"
            assert record["text"] == tokenizer.decode(prompt + continuation)
            assert record["text"] != tokenizer.decode(chunk)  # the second half really was replaced


@pytest.mark.slow  # worker processes
def test_batched_and_multiprocess_regeneration_equal_one_at_a_time(tiny_verifier, tiny_corpus, tmp_path):
    with one_cpu_thread():
        one = regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path / "one", SEQ, max_samples=6, batch_size=1,
                                devices=["cpu"])
        batched = regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path / "batched", SEQ, max_samples=6,
                                    batch_size=4, devices=["cpu"])
        two_processes = regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path / "two", SEQ, max_samples=6,
                                          batch_size=2, devices=["cpu", "cpu"])
    assert len(records(one)) == 6
    assert batched.read_text() == one.read_text()
    assert two_processes.read_text() == one.read_text()


def test_a_relaunch_keeps_done_samples_and_drops_a_torn_line(tiny_verifier, tiny_corpus, tmp_path, capsys):
    with one_cpu_thread():
        path = regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path, SEQ, max_samples=3, batch_size=2,
                                 devices=["cpu"])
        first = records(path)
        first[1]["text"] = "kept as written: a relaunch does not regenerate a done sample"
        path.write_text("".join(json.dumps(r) + "\n" for r in first) + '{"index": 3, "text": "torn')
        regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path, SEQ, max_samples=5, batch_size=2, devices=["cpu"])
        assert "2 samples regenerated (3 already done)" in capsys.readouterr().out
        resumed = records(path)
        assert [r["index"] for r in resumed] == [0, 1, 2, 3, 4]
        assert resumed[:3] == first
        fresh = regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path / "fresh", SEQ, max_samples=5, batch_size=2,
                                  devices=["cpu"])
        assert records(fresh)[3:] == resumed[3:]
        # other settings start over
        regenerate_corpus(tiny_verifier, tiny_corpus, tmp_path, SEQ, max_samples=2, batch_size=2, devices=["cpu"],
                          max_new_tokens=3)
        assert "2 samples regenerated (0 already done)" in capsys.readouterr().out


def test_prepare_regenerates_assistant_turns_and_trains_on_them(verifier, tiny_verifier, tmp_path):
    model, tokenizer = verifier
    conversations = [
        [{"role": "user", "content": "def main"}, {"role": "assistant", "content": "pass"},
         {"role": "user", "content": "import os"}, {"role": "assistant", "content": "return None"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "class A:"},
         {"role": "assistant", "content": "x = 1"}],
    ]
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    out = tmp_path / "prepared"
    with one_cpu_thread():
        assert prepare_main(["--verifier-path", str(tiny_verifier), "--corpus", str(corpus), "--output-dir", str(out),
                             "--max-seq-len", "96", "--draft-vocab-size", "64", "--device", "cpu", "--regenerate",
                             "--regen-max-new-tokens", "12"]) == 0
        regenerated = records(out / REGENERATED_FILE)
        stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        template = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE
        for record, original in zip(regenerated, conversations, strict=True):
            messages = record["messages"]
            assert [m["role"] for m in messages] == [m["role"] for m in original]
            for i, (message, before) in enumerate(zip(messages, original, strict=True)):
                if message["role"] != "assistant":
                    assert message == before
                    continue
                prompt_text = tokenizer.apply_chat_template(messages[:i], chat_template=template, tokenize=False,
                                                            add_generation_prompt=True)
                prompt = tokenizer(prompt_text, add_special_tokens=False).input_ids
                reply = greedy_reference(model, prompt, 12, stop)
                assert message["content"] == tokenizer.decode(reply, skip_special_tokens=True)
    metadata = json.loads((out / "prepare.json").read_text())
    assert metadata["corpus"] == str((out / REGENERATED_FILE).resolve())
    assert metadata["num_samples"] == 2 and metadata["num_loss_tokens"] > 0
