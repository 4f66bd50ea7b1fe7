"""Simulated acceptance: the draft's chain drafting (greedy) on validation data, past its trained depth.

At every position t of a validation sample a round starts, as if the verifier had just accepted the
text up to token t+1: the draft proposes the tokens t+2, t+3, ... one after another, each step reading
its own previous output hidden state, exactly as in TTT (`trainer.ttt.unroll`; step k reads the text's
token t+1+k). Proposal k is accepted when it and every earlier one equal the verifier's top-1 at that
place, which the stored last hidden states (or the stored top-1 ids) give: draft forwards only, no
verifier.

- `sim_acc_k` (k = 1..D): P(the draft's k-th proposal equals the verifier's top-1 | the k-1 before it were
  accepted), over the rounds that reached position k and whose k-th token is trained text (loss mask on,
  in the same sample). A verifier top-1 outside the draft vocabulary is a rejection (the draft can never
  propose it), as in real decoding;
- `sim_tau_d` (d = 1..D): tokens per verifier pass with d proposals, `evaluate`'s τ convention (the
  verifier's own token counted): 1 + Σ_{j<=d} Π_{k<=j} sim_acc_k. It never falls with d.

This is `evaluate`'s `dataset_text` measurement (teacher-forced on the text as written, every position a
round) taken on the validation split during training. Real decoding (`evaluate`'s top level) differs in
two ways: its text is the verifier's own greedy output, not the dataset's, and its rounds start only after
a rejection. On data the verifier generated itself (`trainer.regenerate`) the first difference vanishes.
"""

import torch
from torch import Tensor

from trainer import series
from trainer.model import EagleDraft
from trainer.ttt import ChainObserver, VerifierTargets, trained_positions

COUNT_FIELDS = ("reached", "accepted")


class SimulatedChain(ChainObserver):
    """One batch's chain drafting, fed each TTT step's output hidden state by `TTTObjective`.

    `counts` [depth, 2] (on the device): per draft position, the rounds that reached it and those accepted
    there. Within the trained depth the objective's own comparison of each step decides; past it a step
    computes the draft's logits only at the positions whose chain is still alive, and the chain stops as soon
    as none is (a host read per step: this runs in validation, not in training steps)."""

    def __init__(self, draft: EagleDraft, targets: VerifierTargets, loss_mask: Tensor, depth: int,
                 position_ids: Tensor | None = None):
        self.draft, self.depth = draft, depth
        b, s = loss_mask.shape
        self.top = targets.top.reshape(-1)
        # the step-k target of position t is the verifier's top-1 at row t+1+k: trained text, in t's sample
        trained_text = torch.nn.functional.pad(loss_mask[:, 1:].bool(), (0, 1))
        self.has_target = [m.reshape(-1) for m in trained_positions(trained_text, depth, position_ids)]
        self.alive = torch.ones(b * s, dtype=torch.bool, device=loss_mask.device)
        self.counts = torch.zeros(depth, len(COUNT_FIELDS), device=loss_mask.device)

    @torch.no_grad()
    def __call__(self, step: int, hidden: Tensor, right: Tensor | None = None) -> bool:
        if step >= self.depth:
            return False
        reached = self.alive & self.has_target[step]
        if right is not None:
            # within the trained depth the objective has compared already: its trained positions are the reached
            # ones whose verifier top-1 is in the draft vocabulary (and the others are rejections)
            accepted = reached & right
            self.counts[step, 0] += reached.sum()
            self.counts[step, 1] += accepted.sum()
            self.alive = accepted
            return step + 1 < self.depth
        rows = reached.nonzero().squeeze(1)
        draft_top = self.draft.logits(hidden.reshape(-1, hidden.shape[-1])[rows]).argmax(-1)
        accepted = rows[draft_top == self.top[rows + 1 + step]]
        self.counts[step, 0] += rows.numel()
        self.counts[step, 1] += accepted.numel()
        self.alive = torch.zeros_like(self.alive)
        self.alive[accepted] = True
        return accepted.numel() > 0 and step + 1 < self.depth


def simulated_metrics(counts: Tensor) -> dict[str, float]:
    """`sim_acc_k` and `sim_tau_d` (k, d = 1..depth) from counts [depth, 2] summed over batches and ranks.
    A position no round reached has acceptance 0 (so τ stops growing there)."""
    out: dict[str, float] = {}
    reached, accepted = counts.double().unbind(-1)
    conditional = torch.where(reached > 0, accepted / reached.clamp(min=1), torch.zeros_like(reached))
    taus = 1 + conditional.cumprod(0).cumsum(0)
    for k, value in enumerate(conditional.tolist(), start=1):
        out[series.indexed(series.SIM_ACC, k)] = value
    for d, value in enumerate(taus.tolist(), start=1):
        out[series.indexed(series.SIM_TAU, d)] = value
    return out
