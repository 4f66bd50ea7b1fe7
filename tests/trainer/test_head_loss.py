"""The fast paths of a training step against straightforward references (float64, tiny shapes): verifier
targets from the draft rows of the head, the chunked lm_head + loss, and a step that never waits for the device."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.trainer.test_model import tiny_config, tiny_draft
from trainer.model import TTTCache
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import TrainingStep
from trainer.ttt import STAT_FIELDS, TTTObjective, VerifierTargets, head_loss, verifier_targets
from trainer.verifier_io import VerifierHead


def full_vocabulary_targets(head: VerifierHead, last_hidden_state, loss_mask) -> VerifierTargets:
    """The targets as the full-vocabulary logits define them: softmax over the draft rows, top-1 over all rows."""
    logits = head.logits(last_hidden_state)
    top = head.target_to_draft[logits.argmax(-1)]
    valid = F.pad(loss_mask[:, 1:].bool(), (0, 1)) & (top >= 0)
    return VerifierTargets(logits[..., head.draft_ids].softmax(-1), top, valid)


def mapping(vocab: int, draft_ids: torch.Tensor) -> torch.Tensor:
    target_to_draft = torch.full((vocab,), -1)
    target_to_draft[draft_ids] = torch.arange(draft_ids.numel())
    return target_to_draft


def test_top_token_ties_between_draft_and_other_rows_go_to_the_smaller_target_id():
    """Integer logits, so the draft rows and the other rows tie exactly where the test makes them tie."""
    vocab, hidden = 8, 5
    draft_ids = torch.tensor([1, 2, 5, 6])
    weight = torch.zeros(vocab, hidden, dtype=torch.float64)
    weight[:, 0] = torch.tensor([3, 1, 2, 0, 4, 0, 1, 3], dtype=torch.float64)  # hidden unit 0: top-1 is 4, outside
    weight[:, 1] = torch.tensor([5, 0, 5, 0, 0, 0, 0, 0], dtype=torch.float64)  # unit 1: 0 (other) ties 2 (draft)
    weight[:, 2] = torch.tensor([0, 0, 0, 7, 0, 7, 0, 0], dtype=torch.float64)  # unit 2: 3 (other) ties 5 (draft)
    weight[:, 3] = torch.tensor([0, 0, 0, 0, 0, 9, 9, 2], dtype=torch.float64)  # unit 3: 5 and 6 tie, both draft
    weight[:, 4] = torch.tensor([0, 0, 6, 0, 6, 0, 0, 0], dtype=torch.float64)  # unit 4: 2 (draft) ties 4 (other)
    head = VerifierHead(torch.ones(hidden), 1e-6, weight, draft_ids, mapping(vocab, draft_ids), input_is_normed=True)
    last = torch.eye(hidden, dtype=torch.float64)[None]
    loss_mask = torch.ones(1, hidden, dtype=torch.long)

    targets = verifier_targets(head, last, loss_mask, chunk_rows=3)

    assert targets.top.tolist() == [[-1, -1, -1, 2, 1]]  # outside, other 0 < 2, other 3 < 5, draft 5 < 6, draft 2 < 4
    reference = full_vocabulary_targets(head, last, loss_mask)
    assert torch.equal(targets.top, reference.top)
    assert torch.equal(targets.valid, reference.valid)


@pytest.mark.parametrize("chunk_rows", [1, 4, 64])
def test_targets_from_the_draft_rows_match_the_full_vocabulary(chunk_rows):
    torch.manual_seed(0)
    vocab, hidden, b, s = 40, 12, 2, 9
    draft_ids = torch.randperm(vocab)[:15].sort().values
    weight = torch.randn(vocab, hidden, dtype=torch.float64)
    head = VerifierHead(torch.rand(hidden) + 0.5, 1e-6, weight, draft_ids, mapping(vocab, draft_ids))
    last = torch.randn(b, s, hidden, dtype=torch.float64)
    loss_mask = torch.ones(b, s, dtype=torch.long)
    loss_mask[0, :3] = 0  # a prompt
    loss_mask[1, 6:] = 0  # padding

    targets = verifier_targets(head, last, loss_mask, chunk_rows=chunk_rows)
    reference = full_vocabulary_targets(head, last, loss_mask)

    assert (reference.top < 0).any() and (reference.top >= 0).any()  # both kinds of top-1 occur
    torch.testing.assert_close(targets.probs, reference.probs.float())
    assert torch.equal(targets.top, reference.top)
    assert torch.equal(targets.valid, reference.valid)
    assert torch.equal(head.draft_rows_first().logits(last), head.logits(last))  # reordered rows, same logits


@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
def test_chunked_head_loss_matches_full_logits_loss_and_gradients(chunk_rows):
    torch.manual_seed(1)
    b, s, h, k, offset = 2, 7, 5, 6, 2
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(k, h, dtype=torch.float64, requires_grad=True)
    probs = torch.randn(b, s, k, dtype=torch.float64).softmax(-1)
    scale = torch.rand(b, s, dtype=torch.float64) * (torch.rand(b, s) < 0.7)
    scale[:, s - offset :] = 0  # those positions have no target

    loss, predicted = head_loss(x, weight, probs, scale, offset, chunk_rows)
    (3 * loss).backward()  # the backward pass scales the gradients taken in the forward pass

    ref_x, ref_weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = ref_x[:, : s - offset] @ ref_weight.T
    cross_entropy = -(probs[:, offset:] * logits.log_softmax(-1)).sum(-1)
    ref_loss = (cross_entropy * scale[:, : s - offset]).sum()
    (3 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(weight.grad, ref_weight.grad)
    assert torch.equal(predicted[:, : s - offset], logits.argmax(-1))
    assert (predicted[:, s - offset :] == -1).all()


def reference_objective(draft, hidden_states, input_ids, targets, steps, decay):
    """The TTT objective read plainly: full logits at every position, then the trained ones picked by mask."""
    (b, s), device = input_ids.shape, input_ids.device
    token_qkv = draft.token_qkv(F.pad(input_ids[:, 1:], (0, steps)))
    cos, sin = draft.rope(torch.arange(s + steps - 1, device=device))
    cache, hidden = TTTCache(), draft.fuse(hidden_states)
    chain = torch.ones(b, s, dtype=torch.bool, device=device)
    total, stats = 0.0, []
    for k in range(steps):
        hidden = draft.step(cache, hidden, token_qkv[:, k : k + s], cos[k : k + s], sin[k : k + s])
        logits = draft.logits(hidden)
        valid = torch.zeros(b, s, dtype=torch.bool, device=device)
        valid[:, : s - 1 - k] = targets.valid[:, 1 + k :]
        probs, top = targets.probs[:, 1 + k :], targets.top[:, 1 + k :]
        cross_entropy = -(probs * logits[:, : s - 1 - k].log_softmax(-1)).sum(-1)
        loss_k = cross_entropy[valid[:, : s - 1 - k]].mean()
        total = total + decay**k * loss_k
        right = torch.zeros(b, s, dtype=torch.bool, device=device)
        right[:, : s - 1 - k] = (logits[:, : s - 1 - k].argmax(-1) == top) & valid[:, : s - 1 - k]
        stats.append([loss_k.item(), valid.sum().item(), right.sum().item(), (valid & chain).sum().item(),
                      (right & chain).sum().item()])
        chain = chain & right
    return total, torch.tensor(stats)


def draft_and_head(seed=0):
    """A tiny draft (float32: the attention computes in float32) and a verifier head for its vocabulary."""
    cfg = tiny_config()
    draft = tiny_draft(cfg, seed)
    draft_ids = draft.d2t + torch.arange(cfg.draft_vocab_size)
    torch.manual_seed(seed + 1)
    weight = torch.randn(cfg.vocab_size, cfg.hidden_size)
    weight[draft_ids] *= 1.5  # most, not all, top-1 tokens in the draft vocabulary
    head = VerifierHead(torch.ones(cfg.hidden_size), 1e-6, weight, draft_ids,
                        mapping(cfg.vocab_size, draft_ids))
    return draft, head


def padded_batch(cfg, b=2, s=13, seed=2) -> dict:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(b, s, dtype=torch.long)
    loss_mask[0, :4] = 0  # a prompt
    attention_mask = torch.ones(b, s, dtype=torch.long)
    attention_mask[1, 9:] = 0  # the second row is padded
    loss_mask[1, 9:] = 0
    return {
        "hidden_states": torch.randn(b, s, 3 * cfg.hidden_size, generator=g),
        "last_hidden_state": torch.randn(b, s, cfg.hidden_size, generator=g),
        "input_ids": torch.randint(0, cfg.vocab_size, (b, s), generator=g) * attention_mask,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
    }


@pytest.mark.parametrize("head_chunk_rows", [3, 2048])
def test_objective_matches_the_plain_reference_with_prompts_padding_and_outside_tops(head_chunk_rows):
    draft, head = draft_and_head()
    batch = padded_batch(draft.config)
    targets = verifier_targets(head, batch["last_hidden_state"], batch["loss_mask"])
    assert ((targets.top < 0) & F.pad(batch["loss_mask"][:, 1:].bool(), (0, 1))).any()  # some tops outside
    steps = 4
    params = [p for p in draft.parameters() if p.requires_grad]

    loss, stats = TTTObjective(draft, steps, 0.8, head_chunk_rows=head_chunk_rows)(
        batch["hidden_states"], batch["input_ids"], targets)
    grads = torch.autograd.grad(loss, params)
    ref_loss, ref_stats = reference_objective(draft, batch["hidden_states"], batch["input_ids"], targets, steps, 0.8)
    ref_grads = torch.autograd.grad(ref_loss, params)

    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats, ref_stats, atol=1e-5, rtol=1e-5)
    assert stats[:, STAT_FIELDS.index("chain_after")].min() < stats[:, STAT_FIELDS.index("positions")].max()
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class SyncingOps(TorchDispatchMode):
    """Counts the ops that make the host wait for the device: reading a value, or a shape that depends on one."""

    SYNCING = ("aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::unique",
               "aten::is_nonzero", "aten::item", "aten::equal")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING:
            self.seen.append(func._schema.name)
        elif func._schema.name == "aten::index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append("aten::index by a boolean mask")
        return func(*args, **(kwargs or {}))


def training_step(draft, head, device="cpu") -> TrainingStep:
    objective = TTTObjective(draft, 3, 0.8, head_chunk_rows=5)
    optimizer = build_optimizer(draft.parameters(), 1e-3)
    scheduler = build_scheduler(optimizer, "constant", 10, 0.0)
    noise = torch.Generator(device).manual_seed(0)
    return TrainingStep(objective, objective, head, optimizer, scheduler, 0.05, noise, 0.5)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_step_never_reads_a_value_from_the_device(micro_batches):
    """Targets, the TTT chain, its backward and the clipping queue work without waiting (the optimizer's own step
    counter is a host tensor, read by design; on a GPU the whole step runs under torch's sync check below)."""
    draft, head = draft_and_head()
    step = training_step(draft, head)
    batch = padded_batch(draft.config)
    packed = dict(batch, position_ids=torch.cat([torch.arange(6), torch.arange(7)])[None].expand(2, -1),
                  documents=((6, 7), (6, 7)))
    batches = [batch, packed][:micro_batches]
    with SyncingOps() as syncs:
        loss, stats = step.accumulate_gradients(batches)
        torch.nn.utils.clip_grad_norm_(step.params, step.grad_clip)
    assert syncs.seen == []
    assert loss.isfinite() and stats[:, STAT_FIELDS.index("positions")].min() > 0


def test_the_sync_counter_sees_rows_picked_by_mask_and_values_read():
    """Guard for the test above: the old row selection (`nonzero`), boolean-mask indexing and `.item()` are seen."""
    x, mask = torch.randn(4, 3), torch.tensor([True, False, True, False])
    with SyncingOps() as syncs:
        rows = mask.nonzero(as_tuple=True)
        x[mask].sum().item()
    assert syncs.seen == ["aten::nonzero", "aten::index by a boolean mask", "aten::_local_scalar_dense"]
    assert rows[0].tolist() == [0, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_step_runs_under_the_sync_check():
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=64, target_hidden_size=64, head_dim=16, intermediate_size=128)
    draft = tiny_draft(cfg).cuda()
    draft_ids = (draft.d2t + torch.arange(cfg.draft_vocab_size, device="cuda")).cpu()
    head = VerifierHead(torch.ones(cfg.hidden_size), 1e-6, torch.randn(cfg.vocab_size, cfg.hidden_size), draft_ids,
                        mapping(cfg.vocab_size, draft_ids)).to("cuda", torch.bfloat16)
    step = training_step(draft, head, "cuda")
    batch = {k: v.cuda() for k, v in padded_batch(cfg, s=64).items()}
    batch["hidden_states"] = batch["hidden_states"].bfloat16()
    batch["last_hidden_state"] = batch["last_hidden_state"].bfloat16()
    step([batch])  # the optimizer's state is created in the first step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = step([batch, batch])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.loss.isfinite().item() and result.grad_norm.isfinite().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_bf16_objective_matches_the_plain_reference():
    """Under bf16 autocast, as training runs: the chunked loss keeps its cross-entropy in float32."""
    draft, head = draft_and_head()
    draft.cuda()
    batch = {k: v.cuda() for k, v in padded_batch(draft.config).items()}
    head = head.to("cuda", torch.bfloat16)
    params = [p for p in draft.parameters() if p.requires_grad]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        targets = verifier_targets(head, batch["last_hidden_state"], batch["loss_mask"])
        loss, stats = TTTObjective(draft, 3, 0.8, head_chunk_rows=5)(batch["hidden_states"], batch["input_ids"], targets)
        grads = torch.autograd.grad(loss, params)
        ref_loss, ref_stats = reference_objective(draft, batch["hidden_states"], batch["input_ids"], targets, 3, 0.8)
        ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(loss, ref_loss.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(stats[:, 0].cpu(), ref_stats[:, 0], atol=1e-2, rtol=1e-2)
    for got, want in zip(grads, ref_grads, strict=True):  # bf16 matmuls on both sides: compare as a whole
        assert (got - want).norm() <= 3e-2 * want.norm()
