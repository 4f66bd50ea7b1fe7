"""`trainer.evaluate`: real greedy speculative decoding with tiny verifiers and drafts trained on them.

Two verifiers: the shared tiny one (with a tokenizer, for the CLI), whose greedy text is so regular
that a draft is accepted nearly always, and the random sharp Llama of tiny_setup, where acceptance
is partial (rejections, fall-off with depth)."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.tiny_setup import build_dataset, build_verifier
from trainer.evaluate import (
    DecodeStats,
    DraftProposer,
    Verifier,
    corpus_prompts,
    evaluate,
    speculative_decode,
)
from trainer.evaluate import main as evaluate_main
from trainer.model import TTTCache, load_draft, read_draft_config, save_draft
from trainer.train import main as train_main
from trainer.verifier_io import load_verifier

MAX_DEPTH = 4


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: more threads only contend
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained_draft(one_thread, tiny_verifier, prepared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    code = train_main([
        "--verifier-path", str(tiny_verifier), "--data-dir", str(prepared_data / "hidden_states"),
        "--vocab-mapping-dir", str(prepared_data / "vocab_mapping"), "--output-dir", str(out),
        "--epochs", "6", "--lr", "3e-3", "--max-seq-len", "64", "--num-workers", "0", "--ttt-steps", "3",
        "--noise-std", "0.05", "--scheduler", "cosine", "--warmup-ratio", "0.05", "--val-ratio", "0",
    ])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def verifier_model(tiny_verifier):
    return load_verifier(tiny_verifier, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def partial(one_thread, tmp_path_factory):
    """(verifier, draft, prompts) where the draft is right often but not always."""
    root = tmp_path_factory.mktemp("partial")
    model = build_verifier(root / "verifier")
    build_dataset(model, root / "data", samples=48)
    out = root / "out"
    assert train_main([
        "--verifier-path", str(root / "verifier"), "--data-dir", str(root / "data" / "hidden_states"),
        "--vocab-mapping-dir", str(root / "data" / "vocab_mapping"), "--output-dir", str(out), "--epochs", "6",
        "--lr", "3e-3", "--max-seq-len", "48", "--num-workers", "0", "--ttt-steps", "3", "--val-ratio", "0",
    ]) == 0
    draft = load_draft(out, model.get_input_embeddings().weight.detach())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (8,), generator=g).tolist() for _ in range(6)]
    return Verifier(model, draft.config.aux_hidden_state_layer_ids), draft, prompts


class GreedyOracle:
    """Proposes the verifier's own greedy continuation: every proposal must be accepted."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def __call__(self, tokens, features, depth):
        ids = list(tokens)
        for _ in range(depth):
            ids.append(int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(tokens) :]


def test_oracle_draft_is_accepted_at_every_position(one_thread, verifier_model, tiny_corpus):
    model, tokenizer = verifier_model
    prompts = corpus_prompts(tokenizer, tiny_corpus, max_samples=2, prompt_tokens=16)
    report = evaluate(Verifier(model, [2, 4, 5]), GreedyOracle(model), prompts, 3, 12, None)
    assert report["position_acceptance"] == [1.0, 1.0, 1.0]
    assert [d["mean_accepted"] for d in report["by_depth"]] == [2.0, 3.0, 4.0]
    assert [d["measured_accepted"] for d in report["by_depth"]] == [2.0, 3.0, 4.0]
    only_deepest = evaluate(Verifier(model, [2, 4, 5]), GreedyOracle(model), prompts, 3, 12, None, measure_depths=[])
    assert [d["mean_accepted"] for d in only_deepest["by_depth"]] == [2.0, 3.0, 4.0]
    assert [d["measured_accepted"] for d in only_deepest["by_depth"]] == [None, None, 4.0]


def test_speculative_decoding_reproduces_plain_greedy_decoding(partial):
    verifier, draft, prompts = partial
    stats = DecodeStats()
    for prompt in prompts[:3]:
        generated = speculative_decode(verifier, DraftProposer(draft), prompt, 3, 20, None, stats)
        assert generated == GreedyOracle(verifier.model)(prompt, None, len(generated))
    assert 0 < stats.run_lengths.count(0) < stats.passes  # some rounds rejected at once, some not


def test_proposals_follow_the_trained_ttt_chain(partial):
    """The proposer's chain at the last position equals the training-time TTT forward over the whole
    sequence when that sequence continues with the proposals themselves."""
    verifier, draft, prompts = partial
    verifier.reset()
    features, greedy = verifier.forward(prompts[0])
    tokens = [*prompts[0], greedy[-1]]
    depth = 4
    proposals = DraftProposer(draft)(tokens, features, depth)

    n = features.shape[1]
    ids = torch.tensor([tokens + proposals])
    next_ids = F.pad(ids[:, 1:], (0, depth))  # as TTTObjective builds them
    with torch.no_grad():
        token_qkv = draft.token_qkv(next_ids)
        cos, sin = draft.rope(torch.arange(n + depth))
        cache, hidden = TTTCache(), draft.fuse(features)
        for k in range(depth):
            hidden = draft.step(cache, hidden, token_qkv[:, k : k + n], cos[k : k + n], sin[k : k + n])
            draft_id = int(draft.logits(hidden)[0, n - 1].argmax())
            assert draft_id + int(draft.d2t[draft_id]) == proposals[k], k


def test_report_with_partial_acceptance(partial):
    verifier, draft, prompts = partial
    report = evaluate(verifier, DraftProposer(draft), prompts, 4, 24, None)
    rows = report["by_depth"]
    taus = [row["mean_accepted"] for row in rows]
    assert [row["depth"] for row in rows] == [1, 2, 3, 4]
    assert 1.0 <= taus[0] <= 2.0 and 1.0 <= rows[0]["measured_accepted"] <= 2.0
    assert all(b >= a for a, b in zip(taus, taus[1:], strict=False)), taus  # never falls with depth
    assert taus[-1] == pytest.approx(rows[-1]["measured_accepted"])  # the max-depth run is the measurement
    acceptance = report["position_acceptance"]
    assert len(acceptance) == 4 and all(0.0 <= p <= 1.0 for p in acceptance)
    assert 0.0 < acceptance[0] < 1.0
    assert all(b <= a for a, b in zip(acceptance, acceptance[1:], strict=False)), acceptance
    conditional = report["conditional_acceptance"]
    for depth, tau in enumerate(taus, 1):  # τ(d) = 1 + Σ_{i<d} a_i, a_i = Π_{j<=i} conditional_j
        assert tau == pytest.approx(1 + sum(acceptance[:depth]))
        assert acceptance[depth - 1] == pytest.approx(math.prod(conditional[:depth]))


def test_cli_report_shapes(trained_draft, tiny_verifier, tiny_corpus, tmp_path, capsys):
    report_file = tmp_path / "report.json"
    code = evaluate_main([
        "--verifier-path", str(tiny_verifier), "--draft-path", str(trained_draft), "--corpus", str(tiny_corpus),
        "--max-depth", str(MAX_DEPTH), "--max-samples", "3", "--max-new-tokens", "24", "--prompt-tokens", "16",
        "--output", str(report_file), "--device", "cpu",
    ])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads(report_file.read_text())
    taus = [d["mean_accepted"] for d in report["by_depth"]]
    assert [d["depth"] for d in report["by_depth"]] == list(range(1, MAX_DEPTH + 1))
    assert 1.0 <= taus[0] <= 2.0
    assert all(b >= a for a, b in zip(taus, taus[1:], strict=False)), taus
    assert len(report["position_acceptance"]) == MAX_DEPTH
    assert all(0.0 <= p <= 1.0 for p in report["position_acceptance"])
    assert report["position_acceptance"][0] > 0.2  # the trained draft is much better than chance
    assert report["draft_ttt_steps"] == 3 and report["samples"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exported_draft_reloaded_from_disk_accepts_as_the_draft_in_memory(partial, tmp_path, dtype):
    verifier, draft, prompts = partial
    in_memory = copy.deepcopy(draft)
    with torch.no_grad():  # what the export keeps of each weight (bf16 is how the trainer exports its final draft)
        for parameter in in_memory.parameters():
            parameter.copy_(parameter.to(dtype).float())
    save_draft(draft, tmp_path, dtype=dtype)
    reloaded = load_draft(tmp_path, verifier.model.get_input_embeddings().weight.detach())
    expected = evaluate(Verifier(verifier.model, in_memory.config.aux_hidden_state_layer_ids), DraftProposer(in_memory),
                        prompts, MAX_DEPTH, 16, None)
    got = evaluate(Verifier(verifier.model, read_draft_config(tmp_path).aux_hidden_state_layer_ids),
                   DraftProposer(reloaded), prompts, MAX_DEPTH, 16, None)
    assert got == expected
    assert 0 < expected["position_acceptance"][0] < 1  # partial acceptance: a wrong weight would show
