"""Draft vocabulary: the K most frequent target tokens and the maps between draft and target ids.

On disk (`DIR/vocab_mapping.safetensors`), in the convention vLLM and SGLang use to load EAGLE-3 drafts:
- `d2t` int64 [K]: an OFFSET, `target_id = draft_id + d2t[draft_id]`;
- `t2d` bool [V]: True where the target id is in the draft vocabulary.
Draft ids are assigned in increasing target-id order, so both maps are monotonic.

`load_vocab_mapping` also reads the same two maps as the peers write them: speculators'
scripts/build_vocab_mapping.py (`d2t.npy`, `t2d.npy`) and SpecForge's `vocab_mapping.pt` ({"d2t", "t2d"}).
"""

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB_MAPPING_FILE = "vocab_mapping.safetensors"


def _count_tokens(tokens: Mapping[int, int] | Iterable[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    if isinstance(tokens, Mapping):
        counts = torch.zeros(vocab_size, dtype=torch.long)
        if tokens:
            ids = torch.tensor(list(tokens.keys()), dtype=torch.long)
            values = torch.tensor(list(tokens.values()), dtype=torch.long)
            _check_ids(ids, vocab_size)
            counts.index_add_(0, ids, values)
        return counts
    ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.long)
    ids = ids.reshape(-1).long()
    _check_ids(ids, vocab_size)
    return torch.bincount(ids, minlength=vocab_size)


def _check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}); got [{int(ids.min())}, {int(ids.max())}]. "
            "Pass the verifier's full vocabulary size (config.vocab_size)."
        )


def build_vocab_mapping(
    tokens: Mapping[int, int] | Iterable[int] | torch.Tensor, vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the `draft_vocab_size` most frequent target ids and return `(d2t, t2d)`.

    `tokens` is either a mapping `{token_id: count}` or an iterable / tensor of token ids to count.
    Ties are broken by the smaller id; if fewer than K distinct ids were seen, the smallest unseen ids
    fill the rest, so the draft vocabulary always has exactly K entries.
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    counts = _count_tokens(tokens, vocab_size)
    # A stable sort on -count keeps equal counts (including the unseen zeros) in increasing id order.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def save_vocab_mapping(directory: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    """Write `DIR/vocab_mapping.safetensors`; returns its path."""
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"inconsistent mapping: t2d marks {int(t2d.sum())} ids but d2t has {d2t.numel()}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / VOCAB_MAPPING_FILE
    tmp = path.with_suffix(".tmp")
    save_file(
        {"d2t": d2t.to(torch.long).contiguous(), "t2d": t2d.to(torch.bool).contiguous()},
        str(tmp),
        metadata={"d2t_convention": "offset: target_id = draft_id + d2t[draft_id]"},
    )
    tmp.replace(path)
    return path


def _read_mapping_file(path: Path) -> dict:
    if path.suffix == ".pt":
        return torch.load(path, map_location="cpu", weights_only=True)
    if path.suffix == ".npy":  # speculators writes d2t[-<size>].npy and t2d[-<size>].npy side by side
        import numpy

        size = path.stem.removeprefix("d2t")
        files = {name: path.parent / f"{name}{size}.npy" for name in ("d2t", "t2d")}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path} has no companion {', '.join(missing)}: speculators writes both maps")
        return {name: torch.from_numpy(numpy.load(f)) for name, f in files.items()}
    return load_file(str(path))


def load_vocab_mapping(directory: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read `(d2t, t2d)` from a directory (or file) written by `save_vocab_mapping`, speculators or SpecForge."""
    path = Path(directory)
    if path.is_dir():
        # speculators >= 0.5 names its maps by draft vocab size (d2t-<size>.npy beside its Arrow dataset)
        sized = sorted(path.glob("d2t-*.npy"))
        if len(sized) > 1:
            raise ValueError(f"{path} holds vocab maps of several sizes ({', '.join(p.name for p in sized)}): "
                             "name the directory of one, or the d2t-<size>.npy file itself")
        candidates = [path / VOCAB_MAPPING_FILE, path / "d2t.npy", *sized, path / "vocab_mapping.pt"]
        path = next((c for c in candidates if c.is_file()), candidates[0])
    if not path.is_file():
        raise FileNotFoundError(
            f"no vocab mapping at {path} ({VOCAB_MAPPING_FILE}, speculators' d2t.npy + t2d.npy or "
            "d2t-<size>.npy + t2d-<size>.npy, or SpecForge's vocab_mapping.pt); run `python -m trainer.prepare` "
            "to build one"
        )
    tensors = _read_mapping_file(path)
    for name in ("d2t", "t2d"):
        if name not in tensors:
            raise KeyError(f"{path} has no {name!r}: not a vocab mapping (it holds {sorted(tensors)})")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"{path}: t2d marks {int(t2d.sum())} ids but d2t has {d2t.numel()}: not the same mapping")
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Absolute target id of every draft id: LongTensor [K]."""
    return torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device) + d2t.long()


def target_to_draft_ids(t2d: torch.Tensor) -> torch.Tensor:
    """Draft id of every target id, -1 where the target id is not in the draft vocabulary: LongTensor [V]."""
    mask = t2d.bool()
    ids = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    ids[mask] = torch.arange(int(mask.sum()), dtype=torch.long, device=mask.device)
    return ids
