"""The training objective: T test-time-training steps of the draft against the verifier's distributions.

Indexing (docs/trainer.md, "Why test-time-training steps"): position t of step k reads the token t+1+k and is
trained on the verifier's distribution computed at position t+1+k, i.e. for the token t+2+k.
Step 0's hidden input is the fused verifier features; step k's is the draft's own output of step
k-1 at the same position. The verifier targets are computed once per batch and shifted per step.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer import series
from trainer.fused_loss import soft_cross_entropy
from trainer.model import EagleDraft, TTTCache
from trainer.step_timing import ChainTimer
from trainer.verifier_model import VerifierHead

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
    head: VerifierHead, last_hidden_state: Tensor, loss_mask: Tensor, top_ids: Tensor | None = None,
    chunk_rows: int = 4096,
) -> VerifierTargets:
    """Target distributions from the verifier's last hidden state [B, S, H], in chunks of rows.

    `top_ids` [B, S] are the verifier's top-1 target ids as `prepare` stores them: with them only the
    draft-vocabulary rows of the verifier's lm_head are multiplied (a quarter of a 128k head for a 32k
    draft vocabulary); without them (data written by other tools) the full head gives the top-1 as well."""
    b, s, h = last_hidden_state.shape
    flat = last_hidden_state.reshape(b * s, h)
    probs = torch.empty(b * s, head.draft_ids.numel(), dtype=torch.float32, device=flat.device)
    if top_ids is not None:
        top = head.target_to_draft[top_ids.reshape(-1).long()]
        for start in range(0, b * s, chunk_rows):
            probs[start : start + chunk_rows] = head.draft_logits(flat[start : start + chunk_rows]).float().softmax(-1)
    else:
        top = torch.empty(b * s, dtype=torch.long, device=flat.device)
        for start in range(0, b * s, chunk_rows):
            logits = head.logits(flat[start : start + chunk_rows])
            top[start : start + chunk_rows] = head.target_to_draft[logits.argmax(-1)]
            probs[start : start + chunk_rows] = logits[:, head.draft_ids].float().softmax(-1)
    top = top.view(b, s)
    return VerifierTargets(probs.view(b, s, -1), top, target_valid(loss_mask, top))


def target_valid(loss_mask: Tensor, top: Tensor) -> Tensor:
    """[B, S] bool, at the verifier's position j: the token j+1 has its loss mask on and the verifier's top-1
    there (`top`, as a draft id, -1 outside the draft vocabulary) is in the draft vocabulary."""
    return F.pad(loss_mask[:, 1:].bool(), (0, 1)) & (top >= 0)


def batch_targets(head: VerifierHead, batch: dict) -> VerifierTargets:
    """`verifier_targets` of a loader's batch (its stored top-1 ids when it has them)."""
    return verifier_targets(head, batch["last_hidden_state"], batch["loss_mask"], batch.get("verifier_top_ids"))


def add_feature_noise(hidden_states: Tensor, std: float, generator: torch.Generator | None = None) -> Tensor:
    """Uniform noise in [-std, std] on the captured features (training augmentation)."""
    if std <= 0:
        return hidden_states
    return hidden_states + torch.empty_like(hidden_states).uniform_(-std, std, generator=generator)


def trained_positions(valid: Tensor, ttt_steps: int, position_ids: Tensor | None = None) -> list[Tensor]:
    """Per TTT step k, the positions t [B, S] bool that step trains: those whose target (row t+1+k) is `valid`
    (`VerifierTargets.valid`) and, in packed rows (`position_ids` restarting at 0 for each sample), lies in the
    same sample as t."""
    masks = [F.pad(valid[:, 1 + k :], (0, 1 + k)) for k in range(ttt_steps)]
    if position_ids is not None:
        # the token t+2+k is in t's sample exactly when its position is t's plus 2+k (a new sample restarts at 0)
        masks = [m & (F.pad(position_ids[:, 2 + k :], (0, 2 + k), value=-1) == position_ids + 2 + k)
                 for k, m in enumerate(masks)]
    return masks


def trained_position_counts(targets: VerifierTargets, ttt_steps: int, position_ids: Tensor | None = None) -> Tensor:
    """[T] float: how many positions each TTT step trains (on the device, not read)."""
    return torch.stack([m.sum() for m in trained_positions(targets.valid, ttt_steps, position_ids)]).float()


def _flat_rows(step_valid: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(every step's flat indices b * S + t of the positions it trains, in one tensor; how many per step), from
    `step_valid` [T, B, S] bool."""
    flat = step_valid.flatten(1)
    return flat.nonzero()[:, 1], tuple(flat.sum(1).tolist())


def trained_rows(step_valid: Tensor) -> tuple[Tensor, ...]:
    """Per TTT step, the flat indices b * S + t of the positions it trains, from `step_valid` [T, B, S] bool. On a
    GPU this reads the device twice (the counts, then `nonzero`), and the host waits there for all the work queued
    before it: `plan_trained_rows` does it on the CPU instead, before the batch is copied."""
    rows, counts = _flat_rows(step_valid)
    return rows.split(counts)


def plan_trained_rows(batch: dict, target_to_draft: Tensor, ttt_steps: int, pin: bool = False) -> dict:
    """For a batch still on the CPU that carries the verifier's stored top-1 ids: each TTT step's trained rows
    (`trained_rows`, all steps' flat indices in one tensor, and `trained_counts`, how many per step), as the
    objective would find them on the device. With them a training step needs no read from the GPU, so the host
    queues it while the GPU still runs the one before. `target_to_draft` [V] is the head's, on the CPU. A batch
    without stored top-1 ids gets nothing: its targets need the verifier head first."""
    if batch.get("verifier_top_ids") is None:
        return {}
    valid = target_valid(batch["loss_mask"], target_to_draft[batch["verifier_top_ids"].long()])
    rows, counts = _flat_rows(torch.stack(trained_positions(valid, ttt_steps, batch.get("position_ids"))))
    return {"trained_rows": rows.pin_memory() if pin else rows, "trained_counts": counts}


def planned_rows(batch: dict) -> tuple[Tensor, ...] | None:
    """The per-step trained rows `plan_trained_rows` put in a batch (None when it did not)."""
    if "trained_rows" not in batch:
        return None
    return batch["trained_rows"].split(batch["trained_counts"])


class ChainObserver:
    """What `TTTObjective` hands each step's output hidden state to (see `trainer.simulate`)."""

    depth: int  # the steps it wants the chain unrolled to

    def __call__(self, step: int, hidden: Tensor, right: Tensor | None = None) -> bool:
        """Step `step`'s output hidden state [B, S, H] and, within the trained depth, where the objective found the
        draft's top-1 right ([B * S] bool, False off the trained positions); returns whether it needs more steps."""
        raise NotImplementedError


def unroll(
    draft: EagleDraft, hidden_states: Tensor, input_ids: Tensor, steps: int, position_ids: Tensor | None = None,
    documents: tuple[tuple[int, ...], ...] | None = None,
) -> Iterator[Tensor]:
    """The draft's TTT chain over a batch (TRAINER.md, steps 1-2): yields the output hidden state [B, S, H] of
    each step 0..steps-1. Step k at position t reads the token t+1+k, RoPE position t+k and step k-1's output."""
    b, s = input_ids.shape
    # Work shared by all steps: the token half of q/k/v and the RoPE table.
    next_ids = F.pad(input_ids[:, 1:], (0, steps))  # next_ids[:, p] = token p+1; zeros past the end
    token_qkv = draft.token_qkv(next_ids)
    cos, sin = draft.rope(torch.arange(s + steps - 1, device=input_ids.device))
    cache = TTTCache(documents=documents)
    weights = draft.step_weights()  # cast once for the whole chain
    hidden = draft.fuse(hidden_states)
    for k in range(steps):
        if position_ids is None:
            step_cos, step_sin = cos[k : k + s], sin[k : k + s]
        else:  # RoPE positions restart with each packed sample
            step_cos, step_sin = cos[position_ids + k], sin[position_ids + k]
        hidden = draft.step(cache, hidden, token_qkv[:, k : k + s], step_cos, step_sin, weights)
        yield hidden


class TTTObjective(nn.Module):
    """Runs the T-step TTT chain of the draft over a batch; returns the weighted loss and per-step stats."""

    def __init__(self, draft: EagleDraft, ttt_steps: int, step_decay: float = 0.8):
        super().__init__()
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be at least 1, got {ttt_steps}")
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.step_decay = step_decay
        self.timer: ChainTimer | None = None  # set by the training loop for the steps it times (trainer/step_timing.py)

    def forward(
        self, hidden_states: Tensor, input_ids: Tensor, targets: VerifierTargets, position_ids: Tensor | None = None,
        documents: tuple[tuple[int, ...], ...] | None = None, normalizer: Tensor | None = None,
        rows: tuple[Tensor, ...] | None = None, observer: ChainObserver | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden_states [B, S, 3H], input_ids [B, S]. Returns (Σ_k w^k loss_k, stats [T, len(STAT_FIELDS)]).

        Packed rows pass `position_ids` [B, S] (restarting at 0 for each sample) and `documents` (per row,
        its samples' lengths). loss_k is the mean over the positions step k trains, or their sum over
        `normalizer[k]` when given (the count of a whole accumulated batch). `rows`: each step's trained rows as
        `plan_trained_rows` found them on the CPU (found here otherwise, which waits for the GPU). `observer`
        (no grad: validation) sees every step's output hidden state (and the step's right top-1s), and the chain
        goes on past T for it, to its `depth`, for as long as it asks for more."""
        draft, steps = self.draft, self.ttt_steps
        b, s = input_ids.shape
        device = input_ids.device
        # Work shared by all steps: each step's trained positions (the chain itself shares the rest: `unroll`).
        step_valid = torch.stack(trained_positions(targets.valid, steps, position_ids))  # [T, B, S]
        step_rows = rows if rows is not None else trained_rows(step_valid)
        probs = targets.probs.reshape(b * s, -1)
        top = targets.top.reshape(-1)

        depth = steps if observer is None else max(steps, observer.depth)
        watching = observer is not None
        loss = torch.zeros((), dtype=torch.float32, device=device)
        losses, rights = [], []
        timer = self.timer if observer is None and torch.is_grad_enabled() else None
        if timer is not None:
            timer.start_chain()
        for k, hidden in enumerate(unroll(draft, hidden_states, input_ids, depth, position_ids, documents)):
            if k >= steps:
                if not (watching and observer(k, hidden)):
                    break
                continue
            if timer is not None:
                timer.watch_backward(k, hidden)
            trained = step_rows[k]
            target_rows = trained + (1 + k)
            logits = draft.logits(hidden.reshape(b * s, -1)[trained])
            per_position, draft_top = soft_cross_entropy(logits, probs, target_rows)
            if normalizer is None:
                loss_k = per_position.sum() / max(per_position.numel(), 1)
            else:
                loss_k = per_position.sum() / normalizer[k]
            loss = loss + self.step_decay**k * loss_k
            right = torch.zeros(b * s, dtype=torch.bool, device=device)
            right[trained] = draft_top == top[target_rows]
            losses.append(loss_k.detach())
            rights.append(right)
            if timer is not None:
                timer.forward_done(k)
            watching = watching and observer(k, hidden, right)
        return loss, step_stats(torch.stack(losses), step_valid, torch.stack(rights).view(steps, b, s))


def step_stats(losses: Tensor, valid: Tensor, right: Tensor) -> Tensor:
    """[T, len(STAT_FIELDS)] from each step's loss [T], trained positions and right top-1s [T, B, S] (bool), in a
    few kernels for all steps at once: `chain_*` count the positions where every earlier step was right."""
    chain = torch.cat([torch.ones_like(right[:1]), right[:-1].to(torch.uint8).cumprod(0).bool()])
    counts = torch.stack([valid, right, valid & chain, right & chain], dim=1).flatten(2).sum(-1)
    return torch.cat([losses[:, None].float(), counts.float()], dim=1)


def summarize_stats(stats: Tensor, prefix: str = "") -> dict[str, float]:
    """`loss_k`, `acc_k`, `cond_acc_k` from stats [T, len(STAT_FIELDS)]: counts summed over batches and
    ranks, the loss column already averaged by the caller."""
    out = {}
    for k, (loss, positions, correct, before, after) in enumerate(stats.tolist()):
        out[series.indexed(prefix + series.LOSS, k)] = loss
        out[series.indexed(prefix + series.ACC, k)] = correct / positions if positions else 0.0
        out[series.indexed(prefix + series.COND_ACC, k)] = after / before if before else 0.0
    return out
