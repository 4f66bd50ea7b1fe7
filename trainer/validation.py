"""Validation: the TTT objective on the held-out samples, without gradients or feature noise."""

from collections.abc import Callable

import torch

from trainer.data import BatchLoader, batch_to
from trainer.step import packing
from trainer.ttt import STAT_FIELDS, TTTObjective, batch_targets, summarize_stats
from trainer.verifier_model import VerifierHead


class Validator:
    """Call it at an epoch end: `val_loss` (weighted like training, mean over batches), `val_loss_k`,
    `val_acc_k`, `val_cond_acc_k` over every rank's validation shard, or None when there is none."""

    def __init__(self, objective: TTTObjective, head: VerifierHead, loader: BatchLoader | None,
                 all_ranks_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.objective, self.head, self.loader = objective, head, loader
        self.all_ranks_sum, self.device, self.dtype = all_ranks_sum, device, dtype

    @torch.no_grad()
    def __call__(self) -> dict | None:
        if self.loader is None:
            return None
        steps = self.objective.ttt_steps
        totals = torch.zeros(steps * len(STAT_FIELDS) + 2, device=self.device)
        for batch in self.loader:
            batch = batch_to(batch, self.device, self.dtype)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                targets = batch_targets(self.head, batch)
                loss, stats = self.objective(batch["hidden_states"], batch["input_ids"], targets, **packing(batch))
            totals += torch.cat([loss.float()[None], stats.flatten(), totals.new_ones(1)])
        totals = self.all_ranks_sum(totals).cpu()
        batches = totals[-1].item()
        if batches == 0:
            return None
        stats = totals[1:-1].view(steps, len(STAT_FIELDS))
        stats[:, 0] /= batches
        return {"val_loss": totals[0].item() / batches, **summarize_stats(stats, prefix="val_")}
