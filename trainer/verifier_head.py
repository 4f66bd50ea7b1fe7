"""The few verifier tensors the draft needs, read straight from its safetensors files.

The verifier itself is never instantiated: a trillion-parameter verifier must not be loaded to
train its draft. We read its config.json, the token embedding (frozen into the draft), and the
final norm + lm_head (which turn the captured last hidden state into target distributions).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from trainer.vocab import draft_to_target_ids, target_to_draft_ids


def read_verifier_config(verifier_path: str | Path) -> dict:
    """The verifier's config.json; multimodal wrappers are unwrapped to their text model's config."""
    path = Path(verifier_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --verifier-path must be a Hugging Face model directory")
    config = json.loads(path.read_text())
    text = config.get("text_config") or config.get("language_config")
    if text:
        config = {**config, **text}
    if config.get("tie_word_embeddings") is None:
        config["tie_word_embeddings"] = False
    return config


def _tensor_files(verifier_path: Path) -> dict[str, Path]:
    index = verifier_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: verifier_path / file for name, file in weight_map.items()}
    files = sorted(verifier_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {verifier_path}")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _find(names: dict[str, Path], suffix: str, verifier_path: Path, required: bool = True) -> str | None:
    """The tensor name ending in `suffix` with the shortest prefix (`model.norm.weight` over a vision tower's)."""
    matches = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    if not matches and required:
        raise KeyError(f"no tensor named *{suffix} in {verifier_path}; is this a causal LM checkpoint?")
    return matches[0] if matches else None


def read_verifier_tensors(verifier_path: str | Path) -> dict[str, Tensor]:
    """`embed_tokens`, `norm` and `lm_head` weights (lm_head is the embedding when they are tied)."""
    verifier_path = Path(verifier_path)
    names = _tensor_files(verifier_path)
    wanted = {
        "embed_tokens": _find(names, "embed_tokens.weight", verifier_path),
        "norm": _find(names, "model.norm.weight", verifier_path, required=False) or _find(names, "norm.weight", verifier_path),
        "lm_head": _find(names, "lm_head.weight", verifier_path, required=False),
    }
    tensors = {}
    for key, name in wanted.items():
        if name is not None:
            with safe_open(str(names[name]), framework="pt") as f:
                tensors[key] = f.get_tensor(name)
    tensors.setdefault("lm_head", tensors["embed_tokens"])
    return tensors


@dataclass
class VerifierHead:
    """The verifier's final norm and lm_head, plus the draft-vocabulary maps the targets need."""

    norm_weight: Tensor  # [H]
    norm_eps: float
    lm_head_weight: Tensor  # [V, H]
    draft_ids: Tensor  # [K] target id of each draft id
    target_to_draft: Tensor  # [V] draft id of each target id, -1 if absent

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "VerifierHead":
        return VerifierHead(
            self.norm_weight.to(device, torch.float32),
            self.norm_eps,
            self.lm_head_weight.to(device, dtype),
            self.draft_ids.to(device),
            self.target_to_draft.to(device),
        )

    def logits(self, last_hidden_state: Tensor) -> Tensor:
        """Verifier logits over the full vocabulary from its last decoder layer's output (before norm)."""
        x = last_hidden_state.float()
        x = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.norm_weight, self.norm_eps)
        return x.to(self.lm_head_weight.dtype) @ self.lm_head_weight.T


def load_verifier_head(verifier_path: str | Path, d2t: Tensor, t2d: Tensor) -> tuple[VerifierHead, Tensor]:
    """(the head that computes targets, the embedding weight [V, H] to freeze into the draft), on the CPU."""
    config = read_verifier_config(verifier_path)
    tensors = read_verifier_tensors(verifier_path)
    vocab = tensors["lm_head"].shape[0]
    if t2d.numel() != vocab:
        raise ValueError(
            f"the vocab mapping covers {t2d.numel()} target ids but the verifier's lm_head has {vocab}; "
            "was it built by `trainer.prepare` from this verifier?"
        )
    head = VerifierHead(
        norm_weight=tensors["norm"].float(),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        lm_head_weight=tensors["lm_head"],
        draft_ids=draft_to_target_ids(d2t),
        target_to_draft=target_to_draft_ids(t2d),
    )
    return head, tensors["embed_tokens"]
