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
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.model import SPECULATORS_DIR, EagleDraft, load_draft_weights, save_draft, save_speculators_draft

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
EXPORT_FORMATS = ("engine", "speculators")
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


@dataclass
class Position:
    """Where training stands: optimizer steps taken, and the epoch and batch (loader batches) reached."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly: the draft (engine format), the
    optimizer and scheduler, each rank's RNG and named generators, and the data position.

    It owns its interval (`due`: every `save_every` steps; the loop saves at epoch ends too) and keeps
    the newest `keep` checkpoints. `save` and `restore` are collective: every rank calls them."""

    def __init__(
        self,
        output_dir: str | Path,
        draft: EagleDraft,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        generators: dict[str, torch.Generator],
        settings: dict,
        save_every: int = 0,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] = lambda: None,
        keep: int = 2,
        export_formats: tuple[str, ...] = ("engine",),
        verifier_path: str | None = None,
    ):
        self.output_dir, self.draft, self.optimizer, self.scheduler = Path(output_dir), draft, optimizer, scheduler
        self.generators, self.settings, self.save_every = generators, settings, save_every
        self.rank, self.world_size, self.barrier, self.keep = rank, world_size, barrier, keep
        self.export_formats, self.verifier_path = export_formats, verifier_path

    def due(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0

    def save(self, position: Position) -> Path:
        """Rank 0 writes the shared state, each rank its RNG state and generators; rank 0 then renames the
        directory, refreshes the exported draft and prunes old checkpoints."""
        final = checkpoint_dir(self.output_dir, position.step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        generators = {name: g.get_state() for name, g in self.generators.items()}
        torch.save({"rng": rng_state(), **generators}, tmp / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            save_draft(self.draft, tmp)
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       tmp / "optimizer.pt")
            state = {"step": position.step, "epoch": position.epoch, "batch": position.batch,
                     "world_size": self.world_size, **self.settings}
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        self.barrier()
        if self.rank == 0:
            if final.exists():  # the same step saved by an earlier attempt
                shutil.rmtree(final)
            tmp.rename(final)
            export_draft(self.output_dir, self.draft, self.export_formats, self.verifier_path)
            for old in complete_checkpoints(self.output_dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.barrier()
        return final

    def restore(self, path: Path) -> tuple[Position, dict]:
        """Load everything `save` wrote; returns (the position to continue from, the saved trainer state).

        With a different number of ranks than before, the batch position is rescaled to keep the samples
        seen, roughly, and ranks that did not exist keep their fresh generators."""
        load_draft_weights(self.draft, path)
        state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rank_file = path / f"rng_rank{self.rank}.pt"
        if rank_file.is_file():
            rank_state = torch.load(rank_file, weights_only=False)
            set_rng_state(rank_state.pop("rng"))
            for name, generator in self.generators.items():
                if name in rank_state:
                    generator.set_state(rank_state[name])
        saved = json.loads((path / TRAINER_STATE).read_text())
        batch = saved["batch"] * saved.get("world_size", self.world_size) // self.world_size
        return Position(saved["step"], saved["epoch"], batch), saved


def export_draft(output_dir: str | Path, draft: EagleDraft, formats: tuple[str, ...] = ("engine",),
                 verifier_path: str | None = None) -> None:
    """The newest draft in bf16: at <output-dir>/model.safetensors + config.json for inference engines (always),
    and with "speculators" in `formats` at <output-dir>/speculators/ in speculators' own format."""
    output_dir = Path(output_dir)
    writers = {"engine": (output_dir, lambda d: save_draft(draft, d, dtype=torch.bfloat16))}
    if "speculators" in formats:
        writers["speculators"] = (output_dir / SPECULATORS_DIR, lambda d: save_speculators_draft(
            draft, d, dtype=torch.bfloat16, verifier_path=verifier_path))
    for name, (target, write) in writers.items():
        tmp = output_dir / f".export-{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        target.mkdir(parents=True, exist_ok=True)
        for file in ("model.safetensors", "config.json"):
            (tmp / file).replace(target / file)
        tmp.rmdir()
