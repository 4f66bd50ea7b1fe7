"""Validation: the TTT objective on the held-out samples, without gradients or feature noise, and the
simulated acceptance past the trained depth (`trainer.simulate`) on the same chain."""

from collections.abc import Callable

import torch

from trainer import series
from trainer.data import BatchLoader, batch_to
from trainer.simulate import COUNT_FIELDS, SimulatedChain, simulated_metrics
from trainer.step import packing
from trainer.ttt import STAT_FIELDS, TTTObjective, batch_targets, summarize_stats
from trainer.verifier_model import VerifierHead


class Validator:
    """Call it at an epoch end: `val_loss` (weighted like training, mean over batches), `val_loss_k`,
    `val_acc_k`, `val_cond_acc_k` over every rank's validation shard, or None when there is none.

    With `sim_depth` > 0, also `sim_acc_k` and `sim_tau_d` for k, d = 1..sim_depth: the validation chain
    goes on past the trained depth for them, on this rank's first `sim_rows` validation rows (None: all)."""

    def __init__(self, objective: TTTObjective, head: VerifierHead, loader: BatchLoader | None,
                 all_ranks_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device, dtype: torch.dtype,
                 sim_depth: int = 0, sim_rows: int | None = None):
        self.objective, self.head, self.loader = objective, head, loader
        self.all_ranks_sum, self.device, self.dtype = all_ranks_sum, device, dtype
        self.sim_depth, self.sim_rows = sim_depth, sim_rows

    @torch.no_grad()
    def __call__(self) -> dict | None:
        if self.loader is None:
            return None
        steps, depth = self.objective.ttt_steps, self.sim_depth
        width = steps * len(STAT_FIELDS)
        totals = torch.zeros(width + depth * len(COUNT_FIELDS) + 2, device=self.device)
        rows = 0
        for batch in self.loader:
            batch = batch_to(batch, self.device, self.dtype)
            chain = None
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                targets = batch_targets(self.head, batch)
                if depth and (self.sim_rows is None or rows < self.sim_rows):
                    chain = SimulatedChain(self.objective.draft, targets, batch["loss_mask"], depth,
                                           batch.get("position_ids"))
                    rows += batch["input_ids"].shape[0]
                loss, stats = self.objective(batch["hidden_states"], batch["input_ids"], targets, **packing(batch),
                                             observer=chain)
            sim = chain.counts.flatten() if chain is not None else totals.new_zeros(depth * len(COUNT_FIELDS))
            totals += torch.cat([loss.float()[None], stats.flatten(), sim, totals.new_ones(1)])
        totals = self.all_ranks_sum(totals).cpu()
        batches = totals[-1].item()
        if batches == 0:
            return None
        stats = totals[1 : 1 + width].view(steps, len(STAT_FIELDS))
        stats[:, 0] /= batches
        out = {series.VAL_LOSS: totals[0].item() / batches, **summarize_stats(stats, prefix=series.VAL)}
        if depth:
            out.update(simulated_metrics(totals[1 + width : -1].view(depth, len(COUNT_FIELDS))))
        return out
