"""One optimizer step: verifier targets, the TTT objective over one or several micro-batches, backward,
gradient clipping, AdamW and the schedule.

Several micro-batches (gradient accumulation) make exactly the step of their concatenation: each TTT
step's loss is divided by the positions it trains in the whole batch, counted before the first backward
from the verifier targets (so those of all micro-batches are held at once), and DDP reduces gradients
once, on the last micro-batch (`no_sync` on the others).
"""

import copy
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainer.ttt import TTTObjective, add_feature_noise, batch_targets, planned_rows, trained_position_counts
from trainer.verifier_model import VerifierHead

REHEARSAL_TOKENS = 256  # positions of the first batch a compile rehearsal runs on (more where its loss starts later)


@dataclass
class StepResult:
    """A step's figures, all still on the device (reading them would wait for the GPU)."""

    loss: Tensor
    stats: Tensor  # [T, len(STAT_FIELDS)] as TTTObjective returns them, summed over micro-batches
    grad_norm: Tensor
    tokens: Tensor


def packing(batch: dict) -> dict:
    """The objective's arguments for packed rows (None for one sample per row), and the trained rows where the
    loader planned them."""
    return {"position_ids": batch.get("position_ids"), "documents": batch.get("documents"), "rows": planned_rows(batch)}


class TrainingStep:
    """Call it with the micro-batches of one optimizer step (one, without accumulation)."""

    def __init__(self, model: nn.Module, objective: TTTObjective, head: VerifierHead, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, noise_std: float, noise: torch.Generator,
                 grad_clip: float):
        self.model, self.objective, self.head = model, objective, head
        self.optimizer, self.scheduler, self.grad_clip = optimizer, scheduler, grad_clip
        self.noise_std, self.noise = noise_std, noise
        self.params = [p for p in objective.draft.parameters() if p.requires_grad]

    def __call__(self, micro_batches: Sequence[dict]) -> StepResult:
        loss, stats = self.accumulate_gradients(micro_batches)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = micro_batches[0]["attention_mask"].sum()
        for batch in micro_batches[1:]:
            tokens = tokens + batch["attention_mask"].sum()
        return StepResult(loss, stats, grad_norm, tokens)

    def accumulate_gradients(self, micro_batches: Sequence[dict]) -> tuple[Tensor, Tensor]:
        """Backward of the whole batch's loss into the parameters' .grad; returns (loss, stats), detached."""
        cuda = micro_batches[0]["input_ids"].is_cuda
        if len(micro_batches) == 1:
            (batch,) = micro_batches
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                targets = batch_targets(self.head, batch)
                loss, stats = self.model(self._features(batch), batch["input_ids"], targets, **packing(batch))
            loss.backward()
            return loss.detach(), stats
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            all_targets = [batch_targets(self.head, b) for b in micro_batches]
        steps = self.objective.ttt_steps
        counts = [trained_position_counts(t, steps, b.get("position_ids")) for t, b in zip(all_targets, micro_batches, strict=True)]
        normalizer = torch.stack(counts).sum(0).clamp(min=1)
        total_loss, total_stats = None, None
        for i, (batch, targets) in enumerate(zip(micro_batches, all_targets, strict=True)):
            defer_sync = isinstance(self.model, DistributedDataParallel) and i < len(micro_batches) - 1
            with self.model.no_sync() if defer_sync else nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                    loss, stats = self.model(self._features(batch), batch["input_ids"], targets, **packing(batch),
                                             normalizer=normalizer)
                loss.backward()
            total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
            total_stats = stats if total_stats is None else total_stats + stats
        return total_loss, total_stats

    def _features(self, batch: dict) -> Tensor:
        return add_feature_noise(batch["hidden_states"], self.noise_std, self.noise)


def shadow(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters are the originals' storage as leaves of their own, and whose buffers are
    the originals: a step run on it reads the weights being trained, records nothing on theirs, and does not trip
    over their in-place updates (each leaf has a version counter of its own). It costs no device memory."""
    memo = {id(p): nn.Parameter(p.data, requires_grad=p.requires_grad) for p in module.parameters()}
    memo.update({id(b): b for b in module.buffers()})
    return copy.deepcopy(module, memo)


def rehearsal_lengths(batch: dict) -> list[int]:
    """Two lengths to cut a batch to, so that a compile sees the sequence length vary (Dynamo compiles static,
    then dynamic on a second size): REHEARSAL_TOKENS, or further where the batch's first trained positions lie."""
    s = batch["input_ids"].shape[1]
    trained = batch["loss_mask"].bool().any(0).nonzero()
    first = int(trained[0]) if trained.numel() else 0
    longer = min(s, max(REHEARSAL_TOKENS, first + 96))
    shorter = min(longer - 1, max(first + 32, longer - 48))
    return [longer, shorter] if shorter >= 2 else [longer]


def shortened(batch: dict, length: int) -> dict:
    """The batch's first `length` positions (packed rows' documents cut with them), without its planned trained
    rows (the objective finds those of the cut itself)."""
    s = batch["input_ids"].shape[1]
    out = {}
    for name, value in batch.items():
        if name in ("trained_rows", "trained_counts"):
            continue
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == s:
            value = value[:, :length].clone()
        elif name == "documents":
            value = tuple(_cut_lengths(row, length) for row in value)
        out[name] = value
    return out


def _cut_lengths(lengths: Sequence[int], length: int) -> tuple[int, ...]:
    cut, total = [], 0
    for n in lengths:
        if total >= length:
            break
        cut.append(min(n, length - total))
        total += cut[-1]
    return tuple(cut)


def rehearsal(objective: TTTObjective, head: VerifierHead, batch: dict) -> Callable[[], None]:
    """A forward and backward of the TTT objective on shortened copies of `batch` (a device batch), on a
    `shadow` of the objective, with the gradients thrown away: what `compiled.BackgroundCompile` runs on its
    thread, so that the regions a training step calls are compiled while the training thread steps eagerly. No
    feature noise (the training generator is the training thread's)."""
    rehearsed = shadow(objective)
    params = [p for p in rehearsed.parameters() if p.requires_grad]
    batches = [shortened(batch, n) for n in rehearsal_lengths(batch)]
    device = batch["input_ids"].device

    cuda = device.type == "cuda"

    def rehearse() -> None:
        if cuda:
            torch.cuda.set_device(device)  # the current device is per thread
        for cut in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                targets = batch_targets(head, cut)
                loss, _ = rehearsed(cut["hidden_states"], cut["input_ids"], targets, **packing(cut))
            torch.autograd.grad(loss, params, allow_unused=True)

    return rehearse
