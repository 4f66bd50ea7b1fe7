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
  verifier's own token counted): 1 + Σ_{j<=d} Π_{k<=j} sim_acc_k. It never falls with d;
- `sim_step_acc_k` (k = 1..D): P(the draft's k-th proposal equals the verifier's top-1), over EVERY round whose
  k-th token is trained text, whatever the k-1 before it did. Teacher forcing makes it defined everywhere: step
  k reads the text's tokens, not the draft's earlier proposals, so a round rejected at position 2 still has a
  well-defined proposal 4;
- `sim_rounds_k`, `sim_scored_k`: the denominators of `sim_acc_k` (rounds that reached position k) and of
  `sim_step_acc_k` (rounds with a trained k-th token), so that a reader can put an interval on each rate.

**Survivor bias.** `sim_acc_k` is right for τ (the chain rule: P(1..k accepted) = Π sim_acc_j exactly) but wrong
for "how well does the draft hold up at depth k": its denominator is the rounds that survived k-1 proposals, and
those are the easy contexts (a boilerplate stretch, a repeated name). The deeper k, the more its sample is
selected for ease, so `sim_acc_k` rises with depth even for a draft whose skill is flat, and it hides a draft that
gets worse past its trained depth: the issue's TTT=3 draft showed sim_acc_4..5 0.88 0.87 above the 0.844 kept
inside it (nothing to lift) where decoding of the same draft fell. `sim_step_acc_k` has no such selection (its
denominator is every round), so it is the rate a depth-versus-depth comparison must read: the depth advisor's
retrain rule takes it where it is reported (server/advisor/depth.py, RETRAIN_ASSUMPTION). Scoring every round past
the trained depth costs the draft's logits at every position for every step to D, the cost measured with every
chain alive (docs/benchmarks.md, "Simulated acceptance").

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

COUNT_FIELDS = ("reached", "accepted", "scored", "right")


class SimulatedChain(ChainObserver):
    """One batch's chain drafting, fed each TTT step's output hidden state by `TTTObjective`.

    `counts` [depth, 4] (on the device): per draft position, the rounds that reached it and those accepted
    there (`sim_acc_k`), and every round with a target there and those whose proposal is right whatever came
    before (`sim_step_acc_k`, without the survivor bias). Within the trained depth the objective's own comparison
    of each step decides; past it a step computes the draft's logits at every position with a target, so the
    chain goes on to `depth` (it stops early only where no position has one)."""

    def __init__(self, draft: EagleDraft, targets: VerifierTargets, loss_mask: Tensor, depth: int,
                 position_ids: Tensor | None = None):
        self.draft, self.depth = draft, depth
        b, s = loss_mask.shape
        self.top = targets.top.reshape(-1)
        # the step-k target of position t is the verifier's top-1 at row t+1+k: trained text, in t's sample
        trained_text = torch.nn.functional.pad(loss_mask[:, 1:].bool(), (0, 1))
        # a round is in play at step k while its tokens 1..k are all trained text of its sample: the population of
        # both rates (a masked token ends the round, scored or not)
        self.has_target = list(torch.stack([m.reshape(-1) for m in trained_positions(trained_text, depth, position_ids)])
                               .to(torch.uint8).cumprod(0).bool().unbind(0))
        self.alive = torch.ones(b * s, dtype=torch.bool, device=loss_mask.device)
        self.counts = torch.zeros(depth, len(COUNT_FIELDS), device=loss_mask.device)

    @torch.no_grad()
    def __call__(self, step: int, hidden: Tensor, right: Tensor | None = None) -> bool:
        if step >= self.depth:
            return False
        scored = self.has_target[step]
        if right is None:
            # the objective compared only up to the trained depth: score every position with a target here
            rows = scored.nonzero().squeeze(1)
            draft_top = self.draft.logits(hidden.reshape(-1, hidden.shape[-1])[rows]).argmax(-1)
            right = torch.zeros_like(scored)
            right[rows] = draft_top == self.top[rows + 1 + step]
        # within the trained depth `right` is False off the trained positions: there the verifier's top-1 is outside
        # the draft vocabulary (a rejection) or there is no target (not scored)
        right = right & scored
        reached = self.alive & scored
        self.alive = reached & right
        self.counts[step] += torch.stack([reached.sum(), self.alive.sum(), scored.sum(), right.sum()])
        return step + 1 < self.depth and bool(self.has_target[step + 1].any())

def simulated_metrics(counts: Tensor) -> dict[str, float]:
    """`sim_acc_k`, `sim_tau_d`, `sim_step_acc_k`, `sim_rounds_k` and `sim_scored_k` (k, d = 1..depth) from counts
    [depth, 4] summed over batches and ranks. A position no round reached has acceptance 0 (so τ stops growing)."""
    out: dict[str, float] = {}
    reached, accepted, scored, right = counts.double().unbind(-1)

    def rate(hits: Tensor, of: Tensor) -> Tensor:
        return torch.where(of > 0, hits / of.clamp(min=1), torch.zeros_like(of))

    conditional = rate(accepted, reached)
    taus = 1 + conditional.cumprod(0).cumsum(0)
    for base, values in ((series.SIM_ACC, conditional), (series.SIM_TAU, taus),
                         (series.SIM_STEP_ACC, rate(right, scored)), (series.SIM_ROUNDS, reached),
                         (series.SIM_SCORED, scored)):
        for k, value in enumerate(values.tolist(), start=1):
            out[series.indexed(base, k)] = value
    return out
