"""AdamW and the learning-rate schedules (cosine, linear, constant) with linear warmup."""

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULERS = ("cosine", "linear", "constant")


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused or None)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, scheduler: str) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index `step`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if scheduler == "linear":
        return 1.0 - progress
    if scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, scheduler: str, total_steps: int, warmup_ratio: float
) -> LambdaLR:
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    warmup_steps = math.ceil(warmup_ratio * total_steps)
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, warmup_steps, scheduler))
