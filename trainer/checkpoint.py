"""Checkpoints under <output-dir>/checkpoints/step_XXXXXXXX/ and the exported draft at <output-dir>/.

A checkpoint is written into `step_XXXXXXXX.tmp` and renamed when complete, so a directory under
its final name is always whole. It holds the draft (engine format, fp32), the optimizer and
scheduler state, each rank's RNG state and `trainer_state.json` (step, data position, settings).
"""

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.model import EagleDraft, load_draft_weights, save_draft

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step:08d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    draft: EagleDraft,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict,
    rank_state: dict | None = None,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    keep: int = 2,
) -> Path:
    """Collective: every rank calls it. Rank 0 writes the shared state, each rank its RNG state and
    `rank_state` (e.g. its own generators);
    rank 0 then renames the directory, refreshes the exported draft and prunes old checkpoints."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save({"rng": rng_state(), **(rank_state or {})}, tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        save_draft(draft, tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, **trainer_state}, indent=2) + "\n")
    barrier()
    if rank == 0:
        if final.exists():  # the same step saved by an earlier attempt
            shutil.rmtree(final)
        tmp.rename(final)
        export_draft(output_dir, draft)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(
    path: Path,
    draft: EagleDraft,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int = 0,
) -> tuple[dict, dict]:
    """Restore everything `save_checkpoint` wrote; returns (trainer state, this rank's `rank_state`)."""
    load_draft_weights(draft, path)
    state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rank_state = {}
    rank_file = path / f"rng_rank{rank}.pt"
    if rank_file.is_file():  # absent when resuming with more ranks than before
        rank_state = torch.load(rank_file, weights_only=False)
        set_rng_state(rank_state.pop("rng"))
    return json.loads((path / TRAINER_STATE).read_text()), rank_state


def export_draft(output_dir: str | Path, draft: EagleDraft) -> None:
    """The newest draft at <output-dir>/model.safetensors + config.json, in bf16 for inference engines."""
    output_dir = Path(output_dir)
    tmp = output_dir / ".export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp, dtype=torch.bfloat16)
    for name in ("model.safetensors", "config.json"):
        (tmp / name).replace(output_dir / name)
    tmp.rmdir()
