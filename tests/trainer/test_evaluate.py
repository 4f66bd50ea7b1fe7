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

import trainer.attention as attention
import trainer.model
from tests.trainer.test_model import dense_ttt_attention
from tests.trainer.tiny_setup import build_dataset, build_verifier
from trainer.evaluate import (
    DATASET_MEASUREMENT,
    GREEDY_MEASUREMENT,
    DecodeStats,
    DraftProposer,
    Verifier,
    acceptance_summary,
    corpus_prompts,
    evaluate,
    speculative_decode,
    teacher_forced_runs,
)
from trainer.evaluate import main as evaluate_main
from trainer.model import DraftConfig, EagleDraft, TTTCache, load_draft, read_draft_config, save_draft
from trainer.train import main as train_main
from trainer.verifier_model import load_verifier

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
    assert report["measurement"] == GREEDY_MEASUREMENT and report["prompts"] == 3
    assert report["position_rounds"][0] == report["rounds"] == report["by_depth"][-1]["verifier_passes"]
    dataset = report["dataset_text"]
    assert dataset["measurement"] == DATASET_MEASUREMENT and dataset["prompts"] == 3
    assert dataset["rounds"] == 3 * (16 + 24 - 1 - MAX_DEPTH)  # every position of three full samples
    for measured in (report, dataset):
        rounds = measured["position_rounds"]
        assert all(b <= a for a, b in zip(rounds, rounds[1:], strict=False)), rounds
        for value, bounds in zip(measured["position_acceptance"], measured["position_acceptance_interval"],
                                 strict=True):
            assert bounds[0] <= value <= bounds[1]
    assert report["interval"] == {"confidence": 0.9, "resamples": 2000, "over": "prompts"}


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


def test_summary_counts_rounds_per_position_and_bootstraps_over_prompts():
    runs = [[0, 3, 1], [2, 2], [3, 0, 0, 1]]  # accepted proposals per round, per prompt
    summary = acceptance_summary(runs, 3)
    assert summary["rounds"] == 9 and summary["prompts"] == 3
    assert summary["position_rounds"] == [9, 6, 4]  # rounds with all earlier proposals accepted
    assert summary["position_acceptance"] == pytest.approx([6 / 9, 4 / 9, 2 / 9])
    assert summary["conditional_acceptance"] == pytest.approx([6 / 9, 4 / 6, 2 / 4])
    assert [row["mean_accepted"] for row in summary["by_depth"]] == pytest.approx([15 / 9, 19 / 9, 21 / 9])
    figures = [*zip(summary["position_acceptance"], summary["position_acceptance_interval"], strict=True),
               *zip(summary["conditional_acceptance"], summary["conditional_acceptance_interval"], strict=True),
               *((row["mean_accepted"], row["mean_accepted_interval"]) for row in summary["by_depth"])]
    for value, (low, high) in figures:
        assert low <= value + 1e-9 and value <= high + 1e-9 and low < high  # prompts differ: a real spread
    assert acceptance_summary(runs, 3) == summary  # a fixed seed: the same interval every time

    alike = acceptance_summary([[2, 0, 1]] * 40, 3)  # every prompt the same: no spread
    assert all(low == high for low, high in alike["position_acceptance_interval"])
    many = acceptance_summary(runs * 30, 3)  # the same rounds from 30 times the prompts: a narrower interval
    width = [high - low for low, high in summary["conditional_acceptance_interval"]]
    narrower = [high - low for low, high in many["conditional_acceptance_interval"]]
    assert all(n < w for n, w in zip(narrower, width, strict=True)), (narrower, width)

    never = acceptance_summary([[0, 0], [1]], 3)  # position 3 never reached
    assert never["position_rounds"] == [3, 1, 0]
    assert never["conditional_acceptance"][2] == 0.0 and never["conditional_acceptance_interval"][2] is None


def test_teacher_forced_on_the_verifiers_own_text_equals_decoding(partial):
    """On text the verifier wrote itself, the dataset measurement at the positions where decoding rounds
    start counts exactly the proposals the real decoding accepted there."""
    verifier, draft, prompts = partial
    depth, checked = 4, 0
    for prompt in prompts[:3]:
        stats = DecodeStats()
        generated = speculative_decode(verifier, DraftProposer(draft), prompt, depth, 40, None, stats)
        text = [*prompt, *generated]
        [runs] = teacher_forced_runs(verifier, draft, [(text, [1] * len(text))], depth)
        assert len(runs) == len(text) - 1 - depth  # a round at every position whose chain fits
        read = len(prompt)  # tokens the verifier has read when a round starts
        for accepted in stats.run_lengths:
            if read - 1 < len(runs):
                assert runs[read - 1] == accepted, read
                checked += 1
            read += accepted + 1
    assert checked > 10


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
def test_decode_attention_of_one_position_matches_a_float64_reference(device, monkeypatch):
    """The proposer's chain (queries at the last position only, under bf16 autocast on a GPU) gives the
    logits that the training path (every position, causal plus diagonal keys, with a dense-mask
    attention) computes in float64 on the CPU for the same tokens; and its proposals are their argmax
    wherever that is clear."""
    torch.manual_seed(0)
    config = DraftConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=512, draft_vocab_size=256,
                         target_hidden_size=192, aux_hidden_state_layer_ids=[2, 4, 5], ttt_steps=4)
    reference = EagleDraft(config, torch.randn(config.vocab_size, config.hidden_size)).double().eval()
    reference.d2t.copy_(torch.arange(config.draft_vocab_size) % 7)  # draft id i is target id i + i % 7
    n, depth = 300, 4  # 300: not a multiple of the flash kernel's block size
    features = torch.randn(1, n, 3 * config.target_hidden_size, dtype=torch.float64)
    tokens = torch.randint(0, config.vocab_size, (n + 1,)).tolist()

    draft = EagleDraft(config, reference.embed_weight.float()).to(device).eval()
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in reference.state_dict().items()})
    backends, step_logits = [], []
    causal_backend, logits = attention._causal_backend, draft.logits
    monkeypatch.setattr(attention, "_causal_backend", lambda q: backends.append((q.shape[1], causal_backend(q)))
                        or backends[-1][1])
    monkeypatch.setattr(draft, "logits", lambda hidden: step_logits.append(logits(hidden)) or step_logits[-1])
    proposals = DraftProposer(draft)(tokens, features.float().to(device), depth)
    fast = "cuda_flash" if device == "cuda" else "cpu_flash"
    assert backends == [(n, fast)] + [(1, fast)] * (depth - 1)  # step 0 over the context, then one position
    if device == "cuda":
        assert step_logits[0].dtype == torch.bfloat16

    monkeypatch.setattr(trainer.model, "ttt_attention",  # no kernel in the reference
                        lambda q, keys, values, diag_keys, diag_values, scale, *unpacked_documents:
                        dense_ttt_attention(q, keys, values, diag_keys, diag_values, scale))
    ids = torch.tensor([tokens + proposals])
    with torch.no_grad():
        token_qkv = reference.token_qkv(F.pad(ids[:, 1:], (0, depth)))
        cos, sin = reference.rope(torch.arange(n + depth))
        cache, hidden = TTTCache(), reference.fuse(features)
        for k in range(depth):
            hidden = reference.step(cache, hidden, token_qkv[:, k : k + n], cos[k : k + n], sin[k : k + n])
            want = reference.logits(hidden)[0, n - 1]
            got = step_logits[k][0, -1].double().cpu()
            tolerance = 0.05 * float(want.abs().max()) if device == "cuda" else 1e-4
            torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
            top2 = want.topk(2).values
            if top2[0] - top2[1] > 2 * tolerance:
                draft_id = int(want.argmax())
                assert proposals[k] == draft_id + draft_id % 7, k
