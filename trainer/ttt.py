"""The training objective: T test-time-training steps of the draft against the verifier's distributions.

Indexing (TRAINER.md, "One training step"): position t of step k reads the token t+1+k and is
trained on the verifier's distribution computed at position t+1+k, i.e. for the token t+2+k.
Step 0's hidden input is the fused verifier features; step k's is the draft's own output of step
k-1 at the same position. The verifier targets are computed once per batch and shifted per step.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.model import EagleDraft, TTTCache
from trainer.verifier_io import VerifierHead

# Per TTT step, summed over positions (then over ranks): what the metrics are made of.
STAT_FIELDS = ("loss", "positions", "correct", "chain_before", "chain_after")


@dataclass
class VerifierTargets:
    """Indexed by the verifier's position j, i.e. about the token j+1."""

    probs: Tensor  # [B, S, K] fp32: the verifier's distribution restricted to the draft vocab, renormalised
    top: Tensor  # [B, S] the verifier's top-1 token as a draft id, -1 when outside the draft vocab
    valid: Tensor  # [B, S] bool: the token j+1 has its loss mask on and the top-1 is in the draft vocab


@torch.no_grad()
def verifier_targets(
    head: VerifierHead, last_hidden_state: Tensor, loss_mask: Tensor, chunk_rows: int = 2048
) -> VerifierTargets:
    """Target distributions from the verifier's last hidden state [B, S, H], in chunks of rows.

    Only the draft vocabulary's rows of the lm_head make the distributions. Whether the verifier's top-1
    token is in the draft vocabulary is exactly `argmax over the full vocabulary` (the first index among
    equal maxima) landing on a draft id: the draft rows' maximum beats the other rows' maximum, or ties it
    at a smaller target id. Full-vocabulary logits never exist, and nothing is gathered from them."""
    head = head.draft_rows_first()
    b, s, h = last_hidden_state.shape
    flat = last_hidden_state.reshape(b * s, h)
    vocab = head.draft_ids.numel()
    draft_rows, other_rows = head.lm_head_weight[:vocab], head.lm_head_weight[vocab:]
    probs = torch.empty(b * s, vocab, dtype=torch.float32, device=flat.device)
    top = torch.empty(b * s, dtype=torch.long, device=flat.device)
    for start in range(0, b * s, chunk_rows):
        x = head.normed(flat[start : start + chunk_rows])
        logits = x @ draft_rows.T
        best, best_id = logits.max(-1)
        in_vocab = torch.ones_like(best_id, dtype=torch.bool)
        if other_rows.shape[0]:
            other_best, other_id = (x @ other_rows.T).max(-1)
            in_vocab = (best > other_best) | ((best == other_best) & (head.draft_ids[best_id] < head.other_ids[other_id]))
        top[start : start + chunk_rows] = torch.where(in_vocab, best_id, -1)
        probs[start : start + chunk_rows] = logits.float().softmax(-1)
    top = top.view(b, s)
    valid = F.pad(loss_mask[:, 1:].bool(), (0, 1)) & (top >= 0)
    return VerifierTargets(probs.view(b, s, -1), top, valid)


def add_feature_noise(hidden_states: Tensor, std: float, generator: torch.Generator | None = None) -> Tensor:
    """Uniform noise in [-std, std] on the captured features (training augmentation)."""
    if std <= 0:
        return hidden_states
    return hidden_states + torch.empty_like(hidden_states).uniform_(-std, std, generator=generator)


def soft_cross_entropy_chunk(logits: Tensor, probs: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For logits [N, K] against distributions probs [N, K], each row weighted by scale [N]:
    (Σ scale · cross-entropy, its gradient with respect to the logits, the logits' argmax [N]).

    The gradient is written out (softmax · Σp − p) rather than taken by autograd, so that no per-row
    intermediate outlives the chunk; rows of scale 0 add nothing, even where their cross-entropy is not finite."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = z.logsumexp(-1)
    total = probs.sum(-1)
    cross_entropy = lse * total - (probs * z).sum(-1)  # not a matmul: autocast would round it to bf16
    loss = torch.where(scale > 0, cross_entropy * scale, 0).sum()
    grad = torch.softmax(z, -1).mul_((total * scale)[:, None]).addcmul_(probs, scale[:, None], value=-1)
    return loss, grad.to(logits.dtype), logits.argmax(-1)


def _head_chunks(batch: int, positions: int, chunk_rows: int):
    """(row, start, end) covering positions [0, positions) of every row, at most chunk_rows at a time."""
    for row in range(batch):
        for start in range(0, positions, chunk_rows):
            yield row, start, min(start + chunk_rows, positions)


def _chunked_head_loss(x: Tensor, weight: Tensor, probs: Tensor, scale: Tensor, offset: int, chunk_rows: int,
                       loss_fn, with_grads: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(loss, predicted, d loss / d x, d loss / d weight) of `head_loss`, one chunk of logits at a time."""
    loss = torch.zeros((), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    predicted = torch.full(x.shape[:2], -1, dtype=torch.long, device=x.device)
    grad_x = torch.zeros_like(x) if with_grads else None
    grad_weight = None
    for row, start, end in _head_chunks(x.shape[0], x.shape[1] - offset, chunk_rows):
        rows = x[row, start:end]
        chunk_loss, grad_logits, predicted[row, start:end] = loss_fn(
            rows @ weight.T, probs[row, start + offset : end + offset], scale[row, start:end]
        )
        loss += chunk_loss
        if with_grads:
            grad_x[row, start:end] = grad_logits @ weight
            if grad_weight is None:
                grad_weight = grad_logits.T @ rows
            else:
                grad_weight.addmm_(grad_logits.T, rows)
    if with_grads and grad_weight is None:  # no position has a target
        grad_weight = torch.zeros_like(weight)
    return loss, predicted, grad_x, grad_weight


class _ChunkedHeadLoss(torch.autograd.Function):
    """w · `head_loss` of one TTT step with gradients: each chunk's gradients with respect to its rows and to
    the weight are taken in the forward pass, right after its loss, and the backward pass only scales them
    by the incoming gradient; nothing is computed twice, and logits exist for one chunk at a time.

    The weight's gradient is summed over the steps of a `HeadLoss` as their forward passes go, and handed
    back by the last step alone: the weight is a differentiable input of that step only, so its gradient
    is complete (and DDP all-reduces it) at the start of the backward pass, not at its end."""

    @staticmethod
    def forward(ctx, head: "HeadLoss", step_weight: float, last: bool, offset: int, x: Tensor, weight: Tensor,
                probs: Tensor, scale: Tensor):
        loss, predicted, grad_x, grad_weight = _chunked_head_loss(
            x, head.compute_weight(weight, x.dtype), probs, scale, offset, head.chunk_rows, head.loss_fn, True)
        head.add_weight_gradient(grad_weight, step_weight)
        ctx.step_weight, ctx.head = step_weight, head if last else None
        ctx.save_for_backward(grad_x)
        ctx.mark_non_differentiable(loss, predicted)
        return step_weight * loss, loss, predicted

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_unweighted: Tensor, _grad_predicted: Tensor):
        (grad_x,) = ctx.saved_tensors
        grad_weight = None if ctx.head is None else ctx.head.weight_gradient * grad_loss
        return None, None, None, None, grad_x * (ctx.step_weight * grad_loss), grad_weight, None, None


class HeadLoss:
    """The lm_head + cross-entropy of the TTT steps of one forward pass (`head_loss` at each step).

    Every step's weighted loss must enter one total that is differentiated once: the weight's gradient is
    the steps' sum times the one incoming gradient."""

    def __init__(self, weight: Tensor, steps: int, chunk_rows: int = 2048, loss_fn=soft_cross_entropy_chunk):
        self.weight, self.steps, self.chunk_rows, self.loss_fn = weight, steps, chunk_rows, loss_fn
        self.weight_gradient: Tensor | None = None  # Σ_k w_k d loss_k / d weight, float32
        self._compute_weight: Tensor | None = None

    def compute_weight(self, weight: Tensor, dtype: torch.dtype) -> Tensor:
        """The weight in the rows' dtype (bf16 under autocast), cast once for all steps."""
        if self._compute_weight is None:
            self._compute_weight = weight.detach().to(dtype)
        return self._compute_weight

    def add_weight_gradient(self, grad: Tensor, step_weight: float) -> None:
        if self.weight_gradient is None:
            self.weight_gradient = torch.zeros_like(self.weight, dtype=torch.promote_types(grad.dtype, torch.float32))
        self.weight_gradient.add_(grad, alpha=step_weight)

    def __call__(self, step: int, step_weight: float, x: Tensor, probs: Tensor, scale: Tensor,
                 offset: int) -> tuple[Tensor, Tensor, Tensor]:
        """(step_weight · loss, loss, predicted) of `head_loss` for TTT step `step` of `steps`."""
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            last = step == self.steps - 1
            weight = self.weight if last else self.weight.detach()
            return _ChunkedHeadLoss.apply(self, step_weight, last, offset, x, weight, probs, scale)
        loss, predicted, _, _ = _chunked_head_loss(x, self.compute_weight(self.weight, x.dtype), probs, scale, offset,
                                                   self.chunk_rows, self.loss_fn, False)
        return step_weight * loss, loss, predicted


def head_loss(x: Tensor, weight: Tensor, probs: Tensor, scale: Tensor, offset: int, chunk_rows: int = 2048,
              loss_fn=soft_cross_entropy_chunk) -> tuple[Tensor, Tensor]:
    """(Σ_t scale[b, t] · CE(x[b, t] @ weight.T, probs[b, t + offset]), the argmax draft id at each position
    [B, S], -1 where t + offset is past the end), for the lm_head's input x [B, S, H], its weight [K, H],
    distributions probs [B, S, K] and weights scale [B, S]. Logits exist for `chunk_rows` positions at a time."""
    loss, _, predicted = HeadLoss(weight, 1, chunk_rows, loss_fn)(0, 1.0, x, probs, scale, offset)
    return loss, predicted


def trained_positions(targets: VerifierTargets, ttt_steps: int, position_ids: Tensor | None = None) -> list[Tensor]:
    """Per TTT step k, the positions t [B, S] bool that step trains: those whose target (row t+1+k) is valid
    and, in packed rows (`position_ids` restarting at 0 for each sample), lies in the same sample as t."""
    masks = [F.pad(targets.valid[:, 1 + k :], (0, 1 + k)) for k in range(ttt_steps)]
    if position_ids is not None:
        # the token t+2+k is in t's sample exactly when its position is t's plus 2+k (a new sample restarts at 0)
        masks = [m & (F.pad(position_ids[:, 2 + k :], (0, 2 + k), value=-1) == position_ids + 2 + k)
                 for k, m in enumerate(masks)]
    return masks


def trained_position_counts(targets: VerifierTargets, ttt_steps: int, position_ids: Tensor | None = None) -> Tensor:
    """[T] float: how many positions each TTT step trains (on the device, not read)."""
    return torch.stack([m.sum() for m in trained_positions(targets, ttt_steps, position_ids)]).float()


class TTTObjective(nn.Module):
    """Runs the T-step TTT chain of the draft over a batch; returns the weighted loss and per-step stats."""

    def __init__(self, draft: EagleDraft, ttt_steps: int, step_decay: float = 0.8, compile_loss: bool = False,
                 head_chunk_rows: int = 2048):
        super().__init__()
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be at least 1, got {ttt_steps}")
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.step_decay = step_decay
        self.head_chunk_rows = head_chunk_rows  # positions whose draft logits exist at once
        # one fused kernel for the cross-entropy's elementwise work; chunk lengths vary, hence dynamic shapes
        self.loss_fn = torch.compile(soft_cross_entropy_chunk, dynamic=True) if compile_loss else soft_cross_entropy_chunk

    def forward(
        self, hidden_states: Tensor, input_ids: Tensor, targets: VerifierTargets, position_ids: Tensor | None = None,
        documents: tuple[tuple[int, ...], ...] | None = None, normalizer: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden_states [B, S, 3H], input_ids [B, S]. Returns (Σ_k w^k loss_k, stats [T, len(STAT_FIELDS)]).

        Packed rows pass `position_ids` [B, S] (restarting at 0 for each sample) and `documents` (per row,
        its samples' lengths). loss_k is the mean over the positions step k trains, or their sum over
        `normalizer[k]` when given (the count of a whole accumulated batch)."""
        draft, steps = self.draft, self.ttt_steps
        b, s = input_ids.shape
        device = input_ids.device
        # Work shared by all steps: token half of q/k/v, RoPE table, and each step's trained positions.
        next_ids = F.pad(input_ids[:, 1:], (0, steps))  # next_ids[:, p] = token p+1; zeros past the end
        token_qkv = draft.token_qkv(next_ids)
        cos, sin = draft.rope(torch.arange(s + steps - 1, device=device))
        step_valid = trained_positions(targets, steps, position_ids)
        counts = torch.stack([valid.sum() for valid in step_valid]).float()
        if normalizer is None:
            normalizer = counts.clamp(min=1)

        cache = TTTCache(documents=documents)
        hidden = draft.fuse(hidden_states)
        chain = torch.ones(b, s, dtype=torch.bool, device=device)  # all earlier steps right at this position
        loss = hidden.new_zeros((), dtype=torch.float32)
        head = HeadLoss(draft.lm_head.weight, steps, self.head_chunk_rows, self.loss_fn)
        stats = []
        for k in range(steps):
            if position_ids is None:
                step_cos, step_sin = cos[k : k + s], sin[k : k + s]
            else:  # RoPE positions restart with each packed sample
                step_cos, step_sin = cos[position_ids + k], sin[position_ids + k]
            hidden = draft.step(cache, hidden, token_qkv[:, k : k + s], step_cos, step_sin)
            # every position, weighted 0 where untrained: the positions' count never has to reach the host
            scale = step_valid[k].float() / normalizer[k]
            weighted, loss_k, predicted = head(k, self.step_decay**k, draft.norm(hidden), targets.probs, scale, 1 + k)
            loss = loss + weighted
            right = step_valid[k] & (predicted == F.pad(targets.top[:, 1 + k :], (0, 1 + k), value=-1))
            stats.append(
                torch.stack([
                    loss_k.detach(),
                    counts[k],
                    right.sum().float(),
                    (step_valid[k] & chain).sum().float(),
                    (right & chain).sum().float(),
                ])
            )
            chain = chain & right
        return loss, torch.stack(stats)


def summarize_stats(stats: Tensor, prefix: str = "") -> dict[str, float]:
    """`loss_k`, `acc_k`, `cond_acc_k` from stats [T, len(STAT_FIELDS)]: counts summed over batches and
    ranks, the loss column already averaged by the caller."""
    out = {}
    for k, (loss, positions, correct, before, after) in enumerate(stats.tolist()):
        out[f"{prefix}loss_{k}"] = loss
        out[f"{prefix}acc_{k}"] = correct / positions if positions else 0.0
        out[f"{prefix}cond_acc_{k}"] = after / before if before else 0.0
    return out
