"""The TTT objective: per-step target shifts, verifier targets, the soft cross-entropy, the metrics."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer.fused_loss import soft_cross_entropy
from trainer.ttt import (
    STAT_FIELDS,
    TTTObjective,
    VerifierTargets,
    summarize_stats,
    verifier_targets,
)
from trainer.verifier_model import VerifierHead


class PositionEcho(nn.Module):
    """A stand-in draft whose step-k output at position t is its RoPE position (t + k) and whose
    logits are a sharp one-hot on draft id (position + 1) mod K: it predicts the verifier's target for
    position t+1+k exactly when the objective shifts targets (and RoPE positions) by k at step k."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.bias = nn.Parameter(torch.zeros(()))

    def fuse(self, hidden_states):
        return hidden_states[..., :1] * 0 + self.bias

    def token_qkv(self, token_ids):
        return torch.zeros(*token_ids.shape, 1)

    def rope(self, positions):
        return positions.float(), positions.float()

    def step_weights(self):
        return None

    def step(self, cache, hidden, token_qkv, cos, sin, weights=None):
        return hidden * 0 + cos[None, :, None]

    def logits(self, hidden):
        ids = (hidden.squeeze(-1).round().long() + 1) % self.vocab
        return F.one_hot(ids, self.vocab).float() * 50 + self.bias


def one_hot_targets(b, s, vocab) -> VerifierTargets:
    ids = (torch.arange(s) % vocab).expand(b, s)
    return VerifierTargets(F.one_hot(ids, vocab).float(), ids.clone(), torch.ones(b, s, dtype=torch.bool))


def test_step_k_is_trained_on_targets_shifted_by_k():
    vocab, b, s, steps = 7, 2, 12, 4
    objective = TTTObjective(PositionEcho(vocab), steps, 0.8)
    targets = one_hot_targets(b, s, vocab)
    loss, stats = objective(torch.zeros(b, s, 3), torch.zeros(b, s, dtype=torch.long), targets)
    assert loss.item() < 1e-6
    positions, correct = stats[:, STAT_FIELDS.index("positions")], stats[:, STAT_FIELDS.index("correct")]
    # step k has targets for positions t with t + 1 + k < s, and the last target has no next token
    assert positions.tolist() == [b * (s - 1 - k) for k in range(steps)]
    assert torch.equal(correct, positions)


def test_unshifted_targets_would_fail_the_echo_check():
    """Guard for the test above: with targets off by one step the echo draft is wrong everywhere."""
    vocab, b, s = 7, 1, 12
    targets = one_hot_targets(b, s, vocab)
    shifted = VerifierTargets(targets.probs.roll(1, dims=1), targets.top.roll(1, dims=1), targets.valid)
    loss, stats = TTTObjective(PositionEcho(vocab), 3, 0.8)(torch.zeros(b, s, 3), torch.zeros(b, s, dtype=torch.long), shifted)
    assert loss.item() > 10
    assert stats[:, STAT_FIELDS.index("correct")].sum() == 0


def test_masked_positions_and_out_of_vocab_tops_are_not_trained():
    vocab, b, s = 5, 1, 8
    targets = one_hot_targets(b, s, vocab)
    targets.valid[0, 3] = False
    loss, stats = TTTObjective(PositionEcho(vocab), 2, 0.8)(torch.zeros(b, s, 3), torch.zeros(b, s, dtype=torch.long), targets)
    # row 3 is the target of position 2 at step 0 and of position 1 at step 1
    assert stats[:, STAT_FIELDS.index("positions")].tolist() == [s - 2, s - 3]


def test_verifier_targets_restrict_to_draft_vocab_and_renormalise():
    torch.manual_seed(0)
    vocab, hidden, s = 10, 6, 5
    draft_ids = torch.tensor([1, 4, 7])
    target_to_draft = torch.full((vocab,), -1)
    target_to_draft[draft_ids] = torch.arange(3)
    head = VerifierHead(torch.ones(hidden), 1e-6, torch.randn(vocab, hidden), draft_ids, target_to_draft)
    last = torch.randn(1, s, hidden)
    loss_mask = torch.tensor([[0, 1, 1, 0, 1]])
    targets = verifier_targets(head, last, loss_mask, chunk_rows=2)

    logits = head.logits(last)
    torch.testing.assert_close(targets.probs, logits[..., draft_ids].softmax(-1))
    top = logits.argmax(-1)
    assert torch.equal(targets.top, target_to_draft[top])
    in_vocab = target_to_draft[top] >= 0
    # position j is about token j+1: its loss mask is loss_mask[j+1], and the last position has none
    expected = torch.tensor([[1, 1, 0, 1, 0]], dtype=torch.bool) & in_vocab
    assert torch.equal(targets.valid, expected)


def test_soft_cross_entropy_matches_reference_and_gradients():
    torch.manual_seed(0)
    logits = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    probs = torch.randn(10, 9, dtype=torch.float64).softmax(-1)
    rows = torch.tensor([0, 3, 3, 9, 5, 1])
    got, top = soft_cross_entropy(logits, probs, rows, fused=False)
    want = -(probs[rows] * F.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(got, want)
    assert torch.equal(top, logits.argmax(-1))
    assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, probs, rows, fused=False)[0], (logits,))


def test_verifier_targets_from_stored_top_ids_multiply_only_draft_rows_and_match_the_full_head():
    """With the top-1 ids that `prepare` stores, the targets are those of the full head: same distributions,
    same top-1 draft ids, same valid positions (a top-1 outside the draft vocabulary is not trained)."""
    torch.manual_seed(0)
    vocab, hidden, s = 12, 8, 9
    draft_ids = torch.tensor([0, 2, 5, 6, 11])
    target_to_draft = torch.full((vocab,), -1)
    target_to_draft[draft_ids] = torch.arange(5)
    head = VerifierHead(torch.rand(hidden) + 0.5, 1e-6, torch.randn(vocab, hidden), draft_ids, target_to_draft)
    last = torch.randn(2, s, hidden)
    loss_mask = torch.randint(0, 2, (2, s))
    top_ids = head.logits(last).argmax(-1).int()
    assert (target_to_draft[top_ids.long()] < 0).any() and (target_to_draft[top_ids.long()] >= 0).any()
    full = verifier_targets(head, last, loss_mask, chunk_rows=4)
    stored = verifier_targets(head, last, loss_mask, top_ids, chunk_rows=4)
    torch.testing.assert_close(stored.probs, full.probs)
    assert torch.equal(stored.top, full.top)
    assert torch.equal(stored.valid, full.valid)
    torch.testing.assert_close(head.draft_logits(last), head.logits(last)[..., draft_ids])


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_metrics_have_one_entry_per_ttt_step(steps):
    stats = torch.tensor([[1.0, 10, 5, 10, 5]] * steps)
    metrics = summarize_stats(stats)
    assert sorted(metrics) == sorted(f"{name}_{k}" for k in range(steps) for name in ("loss", "acc", "cond_acc"))
    assert metrics["acc_0"] == 0.5


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
@pytest.mark.parametrize("packed", [False, True])
def test_rows_planned_on_the_cpu_train_exactly_what_the_device_would_find(device, packed):
    """`plan_trained_rows` on the loader's CPU batch (so that a GPU step needs no read before it is queued) gives
    each step the rows the objective finds itself from the verifier targets: same loss, stats and gradients."""
    from tests.trainer.test_model import tiny_config, tiny_draft
    from trainer.data import prefetch_to_device
    from trainer.ttt import plan_trained_rows, planned_rows, trained_positions, trained_rows

    config = tiny_config()
    draft = tiny_draft(config).to(device)
    vocab, k, steps, b, s = config.vocab_size, config.draft_vocab_size, 4, 2, 15
    g = torch.Generator().manual_seed(5)
    draft_ids = torch.randperm(vocab, generator=g)[:k].sort().values
    target_to_draft = torch.full((vocab,), -1)
    target_to_draft[draft_ids] = torch.arange(k)
    head = VerifierHead(torch.rand(config.hidden_size, generator=g) + 0.5, 1e-6, torch.randn(vocab, config.hidden_size,
                        generator=g), draft_ids, target_to_draft).to(device, torch.float32)
    batch = {
        "hidden_states": torch.randn(b, s, 3 * config.target_hidden_size, generator=g),
        "last_hidden_state": torch.randn(b, s, config.hidden_size, generator=g),
        "input_ids": torch.randint(0, vocab, (b, s), generator=g),
        "loss_mask": (torch.rand(b, s, generator=g) > 0.25).long(),
        "verifier_top_ids": torch.randint(0, vocab, (b, s), generator=g).int(),  # some outside the draft vocabulary
    }
    if packed:
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(6), torch.arange(9)]), torch.arange(15)])
        batch["documents"] = ((6, 9), (15,))
    plan = lambda cpu_batch: plan_trained_rows(cpu_batch, target_to_draft, steps, pin=device == "cuda")  # noqa: E731
    (staged,) = prefetch_to_device(iter([batch]), torch.device(device), torch.float32, plan)
    assert staged["trained_rows"].device.type == device and sum(staged["trained_counts"]) > 0

    targets = verifier_targets(head, staged["last_hidden_state"], staged["loss_mask"], staged["verifier_top_ids"])
    found = trained_rows(torch.stack(trained_positions(targets.valid, steps, staged.get("position_ids"))))
    planned = planned_rows(staged)
    assert [r.tolist() for r in planned] == [r.tolist() for r in found]

    results = []
    for rows in (None, planned):
        draft.zero_grad()
        objective = TTTObjective(draft, steps, 0.8)
        loss, stats = objective(staged["hidden_states"], staged["input_ids"], targets, staged.get("position_ids"),
                                staged.get("documents"), rows=rows)
        loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in draft.parameters() if p.grad is not None]))
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(stats_a, stats_b)
    for a, c in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, c)


def test_a_batch_without_stored_top_ids_is_not_planned():
    from trainer.ttt import plan_trained_rows, planned_rows

    batch = {"loss_mask": torch.ones(1, 5, dtype=torch.long)}
    assert plan_trained_rows(batch, torch.zeros(10, dtype=torch.long), 3) == {}
    assert planned_rows(batch) is None
