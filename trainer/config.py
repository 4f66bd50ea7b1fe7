"""The trainer's settings, typed and in sections: what `python -m trainer.train` (trainer/train.py `parse_args`)
returns, and what each part of the trainer takes its own section of.

One field per flag, named as the flag's `dest` (`--max-seq-len` is `max_seq_len`); each field's default is the
flag's (the parser reads it from here). The run spec's `TrainerSpec` (server/spec.py) names the same fields, and
tests/unit/test_trainer_config.py pins the two to each other field for field. Standard library only: the
trainer's dependencies stay small, and a test reads it without torch.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class DataConfig:
    """The stored samples (`--data-dir` in `--data-format`), their split, and how they are batched."""

    data_dir: str
    data_format: str = "auto"
    layer_ids: list[int] | None = None
    max_seq_len: int = 2048
    num_workers: int = 2
    val_ratio: float = 0.05
    batch_size: int = 1
    global_batch_size: int | None = None
    global_batch_tokens: int | None = None
    pack_samples: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """The draft: the verifier it is shaped after and trained against, its vocabulary, its shape and its start."""

    verifier_path: str
    vocab_mapping_dir: str
    draft_num_heads: int | None = None
    draft_num_kv_heads: int | None = None
    draft_head_dim: int | None = None
    fc_norm: bool = False
    norm_output: bool = False
    init_from: str | None = None
    init_lm_head_from_verifier: bool = False


@dataclass(frozen=True)
class TTTConfig:
    """The test-time-training objective: its depth, the weight of each step's loss, the noise on the features."""

    ttt_steps: int = 3
    ttt_step_decay: float = 0.8
    noise_std: float = 0.05


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its schedule: how long (epochs, or a cap in steps), how fast, the gradient's clip."""

    epochs: int = 1
    lr: float = 1e-4
    scheduler: str = "cosine"
    warmup_ratio: float = 0.01
    grad_clip: float = 0.5
    max_steps: int | None = None


@dataclass(frozen=True)
class ValidationConfig:
    """Each epoch's validation and its simulated chain drafting, and the evaluation at the end."""

    sim_depth: int = 16
    sim_samples: int = 256
    eval_corpus: str | None = None
    eval_max_depth: int = 8
    eval_samples: int = 8
    eval_new_tokens: int = 64


@dataclass(frozen=True)
class CheckpointConfig:
    """What the run writes: its output dir (checkpoints, the exported draft), when, in which formats, and the
    experiment trackers."""

    output_dir: str
    save_every: int = 0
    no_resume: bool = False
    export_format: tuple[str, ...] = ("engine",)
    report_to: str | None = None
    tracking_dir: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run, by section; `seed` is the run's own (each section's randomness draws from
    it)."""

    data: DataConfig
    model: ModelConfig
    checkpoints: CheckpointConfig
    ttt: TTTConfig = field(default_factory=TTTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    seed: int = 0  # the data's split and order, the draft's initial weights, the feature noise

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> "TrainConfig":
        """From one value per flag, keyed by the flag's dest (argparse's Namespace as `vars`, or
        `flags()`' output); a flag left out takes its default, an unknown one is a TypeError."""
        unknown = set(flags) - set(FLAG_SECTIONS)
        if unknown:
            raise TypeError(f"unknown trainer settings: {', '.join(sorted(unknown))}")
        sections = {name: kind(**{f.name: flags[f.name] for f in fields(kind) if f.name in flags})
                    for name, kind in SECTIONS.items()}
        return cls(**sections, **({"seed": flags["seed"]} if "seed" in flags else {}))

    def flags(self) -> dict[str, Any]:
        """One value per flag, keyed by its dest: what the checkpoint stores as its `args` (once `vars(args)`)."""
        flat = {key: value for name in SECTIONS for key, value in asdict(getattr(self, name)).items()}
        return {**flat, "seed": self.seed}


SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "checkpoints": CheckpointConfig,
                             "ttt": TTTConfig, "optim": OptimConfig, "validation": ValidationConfig}
# each flag's dest -> the section that holds it ("" for TrainConfig's own `seed`)
FLAG_SECTIONS: dict[str, str] = {**{f.name: name for name, kind in SECTIONS.items() for f in fields(kind)}, "seed": ""}


def flag_field(name: str):
    """The dataclass field of the flag whose dest is `name`."""
    owner = SECTIONS.get(FLAG_SECTIONS[name], TrainConfig)
    return next(f for f in fields(owner) if f.name == name)


def default(name: str) -> Any:
    """The default of the flag whose dest is `name` (e.g. "max_seq_len": 2048); required flags have none."""
    return flag_field(name).default
