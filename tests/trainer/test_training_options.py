"""Training options: packed samples, gradient accumulation, the TTT step decay, the lm_head taken from the
verifier. Each is checked against the plain reference (one sample per row, one micro-batch) on a real tiny
draft: same loss, same gradients, to float tolerance."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.config import DataConfig
from trainer.data import HiddenStatesDataset, PackedBatchSampler, make_loader
from trainer.model import DraftConfig, EagleDraft
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import TrainingStep, packing
from trainer.train import build_draft, micro_batches_per_step, open_data, optimizer_steps, parse_args
from trainer.ttt import STAT_FIELDS, TTTObjective, verifier_targets
from trainer.verifier_model import VerifierHead, read_verifier_config

HIDDEN, VOCAB, DRAFT_VOCAB, TTT_STEPS = 32, 96, 40, 3
LENGTHS = (7, 12, 5, 9, 11, 6)


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> HiddenStatesDataset:
    """Per-sample files of different lengths, loss masks with prompts, shaped for the tiny draft below."""
    directory = tmp_path_factory.mktemp("samples")
    g = torch.Generator().manual_seed(0)
    for i, length in enumerate(LENGTHS):
        loss_mask = torch.ones(length, dtype=torch.uint8)
        loss_mask[: 1 + i % 3] = 0
        save_file({
            "input_ids": torch.randint(0, VOCAB, (length,), generator=g),
            "loss_mask": loss_mask,
            "hidden_states": torch.randn(length, 3 * HIDDEN, generator=g).to(torch.bfloat16),
            "last_hidden_state": torch.randn(length, HIDDEN, generator=g).to(torch.bfloat16),
        }, str(directory / f"sample_{i:06d}.safetensors"))
    return HiddenStatesDataset(directory, max_seq_len=64)


def tiny_draft_and_head() -> tuple[EagleDraft, VerifierHead]:
    torch.manual_seed(0)
    config = DraftConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN, aux_hidden_state_layer_ids=[0, 1, 2], ttt_steps=TTT_STEPS,
    )
    draft = EagleDraft(config, torch.randn(VOCAB, HIDDEN))
    draft_ids = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    target_to_draft = torch.full((VOCAB,), -1)
    target_to_draft[draft_ids] = torch.arange(DRAFT_VOCAB)
    # a sharp head whose top tokens are mostly in the draft vocabulary
    lm_head = torch.randn(VOCAB, HIDDEN) * 0.1
    lm_head[draft_ids] *= 10
    return draft, VerifierHead(torch.ones(HIDDEN), 1e-6, lm_head, draft_ids, target_to_draft)


def float_batch(batch: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def loss_and_gradients(draft, head, batch, **objective_args):
    draft.zero_grad(set_to_none=True)
    targets = verifier_targets(head, batch["last_hidden_state"], batch["loss_mask"])
    loss, stats = TTTObjective(draft, TTT_STEPS, 0.8)(batch["hidden_states"], batch["input_ids"], targets, **objective_args)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


def assert_same(reference, other):
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = reference, other
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats_b, stats_a, rtol=1e-5, atol=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("rows", [[[0, 1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4], [5]]])
def test_packed_samples_give_the_loss_and_gradients_of_one_sample_per_row(samples, rows):
    draft, head = tiny_draft_and_head()
    reference = loss_and_gradients(draft, head, float_batch(samples.read_batch(range(len(LENGTHS)))))
    packed = float_batch(samples.read_packed_batch(rows))
    assert packed["input_ids"].shape[0] == len(rows)
    assert reference[1][:, STAT_FIELDS.index("positions")].min() > 0  # every TTT step trains somewhere
    assert_same(reference, loss_and_gradients(draft, head, packed, **packing(packed)))


def test_without_the_sample_boundaries_a_packed_row_would_differ(samples):
    """Guard for the test above: attention, positions or targets crossing samples change the loss."""
    draft, head = tiny_draft_and_head()
    reference = loss_and_gradients(draft, head, float_batch(samples.read_batch(range(len(LENGTHS)))))
    packed = float_batch(samples.read_packed_batch([list(range(len(LENGTHS)))]))
    leaky = loss_and_gradients(draft, head, packed)
    assert (leaky[1][:, STAT_FIELDS.index("positions")] > reference[1][:, STAT_FIELDS.index("positions")]).all()
    only_attention = loss_and_gradients(draft, head, packed, position_ids=packed["position_ids"])
    assert not torch.allclose(only_attention[0], reference[0], rtol=1e-4)


def test_a_packed_row_restarts_positions_and_lists_its_samples(samples):
    batch = samples.read_packed_batch([[1, 2], [0]])
    assert batch["documents"] == ((12, 5), (7, 10))  # the second row's pad tail counts as one more document
    assert batch["position_ids"][0].tolist() == list(range(12)) + list(range(5))
    assert batch["attention_mask"].sum(1).tolist() == [17, 7]
    whole = [load_file(str(samples.files[i])) for i in (1, 2)]
    assert torch.equal(batch["hidden_states"][0], torch.cat([w["hidden_states"] for w in whole]))
    assert not batch["loss_mask"][1, 7:].any()


def test_packed_batches_cover_every_sample_once_within_the_row_limit_on_every_rank():
    lengths = [5, 30, 12, 7, 7, 20, 3, 40, 9, 16, 25]
    for epoch in (0, 1):
        samplers = [PackedBatchSampler(lengths, 32, 2, seed=3, rank=r, world_size=2, epoch=epoch) for r in (0, 1)]
        batches = [list(s) for s in samplers]
        assert len(batches[0]) == len(batches[1]) == samplers[0].batches_in_epoch(epoch)
        rows = [row for rank in batches for batch in rank for row in batch]
        assert all(sum(min(lengths[i], 32) for i in row) <= 32 for row in rows)
        assert all(len(batch) <= 2 for rank in batches for batch in rank)
        seen = sorted(i for row in rows for i in row)
        assert set(seen) == set(range(len(lengths))) and len(seen) >= len(lengths)  # short rank may repeat
    sampler = PackedBatchSampler(lengths, 32, 1, seed=3)
    every = list(sampler)
    sampler.set_epoch(0, start_batch=2)
    assert list(sampler) == every[2:]


def accumulation_step(draft, head, micro_batches) -> TrainingStep:
    objective = TTTObjective(draft, TTT_STEPS, 0.8)
    optimizer = build_optimizer(draft.parameters(), 1e-3)
    return TrainingStep(objective, objective, head, optimizer, build_scheduler(optimizer, "constant", 10, 0.0),
                        noise_std=0.0, noise=torch.Generator(), grad_clip=0.5)


def accumulated(draft, head, micro_batches):
    draft.zero_grad(set_to_none=True)
    loss, stats = accumulation_step(draft, head, micro_batches).accumulate_gradients(micro_batches)
    return loss, stats, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("packed", [False, True])
def test_accumulated_micro_batches_give_the_step_of_the_whole_batch(samples, packed):
    draft, head = tiny_draft_and_head()
    if packed:
        whole = [float_batch(samples.read_packed_batch([[0, 1], [2, 3], [4, 5]]))]
        micro = [float_batch(samples.read_packed_batch(rows)) for rows in ([[0, 1]], [[2, 3], [4, 5]])]
    else:
        whole = [float_batch(samples.read_batch(range(6)))]
        micro = [float_batch(samples.read_batch(indices)) for indices in ([0, 1], [2], [3, 4, 5])]
    reference = accumulated(draft, head, whole)
    assert_same(reference, accumulated(draft, head, micro))
    # and the optimizer step after it: the same weights
    after = {}
    for name, batches in (("whole", whole), ("micro", micro)):
        draft, head = tiny_draft_and_head()
        result = accumulation_step(draft, head, batches)(batches)
        assert int(result.tokens) == sum(LENGTHS)
        after[name] = [p.detach().clone() for p in draft.parameters()]
    for a, b in zip(after["whole"], after["micro"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_mean_of_micro_batch_losses_would_not_be_the_whole_batch_step(samples):
    """Guard for the test above: micro-batches with different counts of trained positions, each averaged on
    its own, weigh positions unequally."""
    draft, head = tiny_draft_and_head()
    whole = accumulated(draft, head, [float_batch(samples.read_batch(range(6)))])
    parts = [accumulated(draft, head, [float_batch(samples.read_batch(i))]) for i in ([0, 1], [2], [3, 4, 5])]
    assert not torch.allclose(sum(p[0] for p in parts) / 3, whole[0], rtol=1e-3)


def test_global_batch_in_sequences_or_tokens_sets_the_micro_batches_per_step():
    def args(**flags):
        return replace(DataConfig("/d", batch_size=2, max_seq_len=1024), **flags)

    assert micro_batches_per_step(args(), world_size=4) == 1
    assert micro_batches_per_step(args(global_batch_size=32), world_size=4) == 4
    with pytest.raises(SystemExit, match="multiple of --batch-size x ranks = 8"):
        micro_batches_per_step(args(global_batch_size=12), world_size=4)
    assert micro_batches_per_step(args(global_batch_tokens=65536), world_size=4) == 8
    assert micro_batches_per_step(args(global_batch_tokens=1000), world_size=4) == 1
    assert [len(g) for g in optimizer_steps(range(7), 3)] == [3, 3, 1]


@pytest.mark.parametrize("decay", [1.0, 0.8, 0.5])
def test_ttt_step_k_is_weighted_decay_to_the_k(samples, decay):
    draft, head = tiny_draft_and_head()
    batch = float_batch(samples.read_batch(range(6)))
    targets = verifier_targets(head, batch["last_hidden_state"], batch["loss_mask"])
    loss, stats = TTTObjective(draft, TTT_STEPS, decay)(batch["hidden_states"], batch["input_ids"], targets)
    step_losses = stats[:, STAT_FIELDS.index("loss")]
    torch.testing.assert_close(loss.detach(), sum(decay**k * step_losses[k] for k in range(TTT_STEPS)))


def test_help_names_the_decay_each_reference_trainer_uses(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "EAGLE-3 and SpecForge use 0.8; speculators 1.0" in text
    for flag in ("--global-batch-size", "--global-batch-tokens", "--pack-samples", "--init-lm-head-from-verifier"):
        assert flag in text


def test_lm_head_starts_from_the_verifier_rows_of_the_draft_vocabulary(tmp_path: Path):
    from tests.trainer.tiny_setup import build_dataset, build_verifier

    verifier = build_verifier(tmp_path / "verifier")
    build_dataset(verifier, tmp_path / "data", samples=4, length=12)
    flags = ["--verifier-path", str(tmp_path / "verifier"), "--data-dir", str(tmp_path / "data" / "hidden_states"),
             "--vocab-mapping-dir", str(tmp_path / "data" / "vocab_mapping"), "--output-dir", str(tmp_path / "out")]
    mapping = load_file(str(tmp_path / "data" / "vocab_mapping" / "vocab_mapping.safetensors"))
    target_ids = torch.arange(mapping["d2t"].numel()) + mapping["d2t"]  # d2t holds offsets: target = i + d2t[i]
    verifier_rows = verifier.lm_head.weight.detach()[target_ids]

    def draft_of(config):
        verifier = read_verifier_config(config.model.verifier_path)
        return build_draft(config.model, verifier, open_data(config.data, verifier), config.ttt.ttt_steps,
                           torch.float32, None, config.seed)

    draft, _ = draft_of(parse_args([*flags, "--init-lm-head-from-verifier"]))
    assert torch.equal(draft.lm_head.weight.detach(), verifier_rows)
    fresh, _ = draft_of(parse_args(flags))
    assert not torch.allclose(fresh.lm_head.weight.detach(), verifier_rows)
    with pytest.raises(SystemExit):
        parse_args([*flags, "--init-lm-head-from-verifier", "--init-from", str(tmp_path / "out")])


def test_a_packed_loader_reads_packed_rows(samples):
    loader = make_loader(samples, 2, num_workers=1, shuffle=False, pack=True)
    batches = list(loader)
    assert all("documents" in b and b["position_ids"].shape == b["input_ids"].shape for b in batches)
    assert sum(int(b["attention_mask"].sum()) for b in batches) == sum(LENGTHS)


def test_a_run_spec_passes_the_new_options_to_the_trainer():
    from server.schemas import TrainerSpec
    from worker.jobs import trainer_flags

    spec = TrainerSpec(verifier_path="/v", data_dir="/d", vocab_mapping_dir="/m", output_dir="/o",
                       global_batch_tokens=65536, pack_samples=True, init_lm_head_from_verifier=True)
    config = parse_args(trainer_flags(spec))
    assert (config.data.global_batch_tokens, config.data.pack_samples,
            config.model.init_lm_head_from_verifier) == (65536, True, True)
    assert config.data.global_batch_size is None
