"""A demo verifier that needs no download: a small Llama trained briefly on the Python standard library.

    python -m trainer.demo_verifier --output-dir DIR [--size tiny|small|base] [--corpus-dir DIR] [--steps N]

Writes a standard Hugging Face directory (config.json, model.safetensors, generation_config.json,
tokenizer.json + tokenizer_config.json with a ChatML chat template) plus `corpus/train.jsonl` and
`corpus/heldout.txt` (disjoint source files) for the demo. `verifier_build.json` is written last; when
it matches the requested settings the build is skipped, before torch or transformers is even imported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trainer.timefmt import duration

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

STAMP_FILE = "verifier_build.json"
# the training prints a progress line at least this often (seconds), and at each tenth of its steps
REPORT_SECONDS = 15.0
BUILD_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "corpus/train.jsonl",
)
STAMP_FORMAT = 1
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS_PATTERNS = ("*.py", "*.txt", "*.md")
# Installed third-party packages live inside the stdlib tree on some installs; they are not the stdlib.
THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class VerifierPreset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    # Which stdlib sources: its top-level modules (4.7 MB on 3.11), the package tree without the test
    # suites (12 MB), or with them (31 MB). Larger models get more text so that they do not just memorise.
    sources: Literal["top-level", "tree", "tree-with-tests"]


# Measured: tiny 90-120 s on 2 CPU cores (heldout loss 5.4, greedy top-1 0.15, ~50 distinct predictions);
# on one H200, small 87 s (heldout 3.0, top-1 0.44) and base 113 s (heldout 3.6, top-1 0.42).
PRESETS: dict[str, VerifierPreset] = {
    "tiny": VerifierPreset(4096, 128, 352, 8, 4, 2, 128, 16, 300, 3e-3, sources="top-level"),
    "small": VerifierPreset(8192, 384, 1024, 12, 6, 2, 512, 16, 1500, 1e-3, sources="tree"),
    "base": VerifierPreset(32000, 1024, 2816, 16, 16, 4, 1024, 32, 500, 6e-4, sources="tree-with-tests"),
}


def find_source_files(
    root: Path,
    recursive: bool,
    patterns: Sequence[str] = ("*.py",),
    excluded_dirs: frozenset[str] = THIRD_PARTY_DIRS,
) -> list[Path]:
    """Source files under `root` in a deterministic order (sorted relative paths)."""
    found: set[Path] = set()
    for pattern in patterns:
        for path in root.rglob(pattern) if recursive else root.glob(pattern):
            if path.is_file() and not excluded_dirs & set(path.relative_to(root).parts[:-1]):
                found.add(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_source_files(sources: str) -> list[Path]:
    root = stdlib_root()
    if sources == "top-level":
        return find_source_files(root, recursive=False)
    excluded = THIRD_PARTY_DIRS if sources == "tree-with-tests" else THIRD_PARTY_DIRS | TEST_DIRS
    return find_source_files(root, recursive=True, excluded_dirs=excluded)


def stdlib_root() -> Path:
    return Path(os.__file__).resolve().parent


def split_heldout(files: Sequence[Path], root: Path, every: int = 20) -> tuple[list[Path], list[Path]]:
    """About 1 file in `every` is held out, chosen by a hash of its relative path (stable across machines)."""
    heldout = [f for f in files if zlib.crc32(f.relative_to(root).as_posix().encode()) % every == 0]
    if not heldout and len(files) >= 2:
        heldout = [files[-1]]
    train = [f for f in files if f not in set(heldout)]
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, no BOS added) with end-of-text, pad and ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path, max_length: int) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers 4.x and 5.x both load."""
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _fingerprint(files: Sequence[Path], root: Path) -> dict:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\n".encode())
    return {"root": str(root), "files": len(files), "sha256": digest.hexdigest()}


def _encode_files(tokenizer: Tokenizer, files: Sequence[Path], eos_id: int) -> torch.Tensor:
    import torch

    ids: list[int] = []
    for encoding in tokenizer.encode_batch([read_text(f) for f in files]):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def _lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _evaluate(
    model: LlamaForCausalLM, tokens: torch.Tensor, seq_len: int, windows: int, device: torch.device
) -> dict:
    """Next-token loss, greedy top-1 accuracy and the number of distinct greedy predictions."""
    import torch

    count = min(windows, (tokens.numel() - 1) // seq_len)
    if count == 0:
        return {}
    batch = tokens[: count * seq_len + 1]
    inputs = batch[:-1].view(count, seq_len).to(device)
    targets = batch[1:].view(count, seq_len).to(device)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=inputs).logits.float()
    model.train()
    predictions = logits.argmax(-1)
    return {
        "heldout_loss": round(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item(), 4
        ),
        "heldout_top1": round((predictions == targets).float().mean().item(), 4),
        "distinct_predictions": int(predictions.unique().numel()),
    }


def _train(
    model: LlamaForCausalLM, tokens: torch.Tensor, preset: VerifierPreset, seed: int, device: torch.device
) -> list[float]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=0.01)
    span = preset.seq_len + 1
    if tokens.numel() <= span:
        raise ValueError(f"training text has {tokens.numel()} tokens, fewer than one window of {span}")
    losses = []
    model.train()
    print(f"toy verifier: training {preset.steps} steps of {preset.batch_size} x {preset.seq_len} tokens on {device.type}",
          flush=True)
    started = last_report = time.monotonic()
    for step in range(preset.steps):
        starts = torch.randint(0, tokens.numel() - span + 1, (preset.batch_size,), generator=generator)
        batch = torch.stack([tokens[s : s + span] for s in starts.tolist()]).to(device)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, preset.steps, preset.lr)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        done, now = step + 1, time.monotonic()
        # a line each tenth of the steps, or each REPORT_SECONDS on a slow (busy) machine, with the time it has
        # taken and the ETA at the pace so far: the first command a user runs is not silent for minutes
        if done % max(1, preset.steps // 10) == 0 or now - last_report >= REPORT_SECONDS or done == preset.steps:
            last_report, elapsed = now, now - started
            eta = f", ETA {duration(elapsed / done * (preset.steps - done))}" if done < preset.steps else ""
            print(f"toy verifier: step {done}/{preset.steps} ({100 * done / preset.steps:.0f}%) loss {losses[-1]:.3f}, "
                  f"{duration(elapsed)} so far{eta}", flush=True)
    return losses


def _read_stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def build_verifier(
    output_dir: str | Path,
    preset: str | VerifierPreset = "tiny",
    source_files: Sequence[str | Path] | None = None,
    corpus_dir: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    device: str | None = None,
) -> dict:
    """Build (or find already built) the demo verifier in `output_dir`; returns the build summary.

    Text comes from `source_files` if given, else from `corpus_dir` (*.py, *.txt, *.md, recursive),
    else from the standard library's sources.
    """
    output_dir = Path(output_dir)
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown size {preset!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    if steps is not None:
        preset = replace(preset, steps=steps)
    if source_files is not None:
        files = [Path(f).resolve() for f in source_files]
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
    elif corpus_dir is not None:
        root = Path(corpus_dir).resolve()
        files = find_source_files(root, recursive=True, patterns=CORPUS_PATTERNS)
    else:
        root = stdlib_root()
        files = stdlib_source_files(preset.sources)
    if not files:
        raise FileNotFoundError(
            f"no source text found under {root}; pass --corpus-dir with *.py/*.txt/*.md files"
        )

    settings = {
        "format": STAMP_FORMAT,
        "preset": asdict(preset),
        "seed": seed,
        "sources": _fingerprint(files, root),
    }
    stamp = _read_stamp(output_dir)
    complete = all((output_dir / name).is_file() for name in BUILD_FILES)
    if stamp is not None and stamp.get("settings") == settings and complete:
        return {**stamp["summary"], "cached": True}

    # Imported only now so that a cached build returns without loading them.
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    torch.manual_seed(seed)
    run_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / STAMP_FILE).unlink(missing_ok=True)
    train_files, heldout_files = split_heldout(files, root)

    tokenizer = train_tokenizer((read_text(f) for f in train_files), preset.vocab_size)
    save_tokenizer(tokenizer, output_dir, max_length=preset.seq_len * 4)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    train_tokens = _encode_files(tokenizer, train_files, eos_id)
    heldout_tokens = (
        _encode_files(tokenizer, heldout_files, eos_id) if heldout_files else torch.empty(0, dtype=torch.long)
    )

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.seq_len * 4,
        rms_norm_eps=1e-5,
        # Untied so that model.safetensors holds lm_head.weight, which the draft borrows by name.
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    model = LlamaForCausalLM(config).to(run_device)
    losses = _train(model, train_tokens, preset, seed, run_device)
    evaluation = _evaluate(model, heldout_tokens, preset.seq_len, windows=16, device=run_device)

    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False
    )
    model.to("cpu").save_pretrained(output_dir)
    corpus_dir_out = output_dir / "corpus"
    corpus_dir_out.mkdir(exist_ok=True)
    with open(corpus_dir_out / "train.jsonl", "w") as out:
        for f in train_files:
            out.write(json.dumps({"text": read_text(f), "source": f.relative_to(root).as_posix()}) + "\n")
    (corpus_dir_out / "heldout.txt").write_text("\n\n".join(read_text(f) for f in heldout_files))

    tail = losses[-max(1, len(losses) // 20) :]
    summary = {
        "path": str(output_dir),
        "params": sum(p.numel() for p in model.parameters()),
        "layers": preset.num_layers,
        "hidden_size": preset.hidden_size,
        "vocab_size": config.vocab_size,
        "steps": preset.steps,
        "train_tokens": train_tokens.numel(),
        "initial_loss": round(losses[0], 4),
        "final_loss": round(sum(tail) / len(tail), 4),
        **evaluation,
        "seconds": round(time.monotonic() - started, 1),
        "device": str(run_device),
    }
    stamp_tmp = output_dir / (STAMP_FILE + ".tmp")
    stamp_tmp.write_text(json.dumps({"settings": settings, "summary": summary}, indent=2) + "\n")
    stamp_tmp.replace(output_dir / STAMP_FILE)
    return {**summary, "cached": False}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.demo_verifier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--size", choices=sorted(PRESETS), default="tiny")
    parser.add_argument(
        "--corpus-dir", type=Path, help="train on *.py/*.txt/*.md under this dir instead of the stdlib"
    )
    parser.add_argument("--steps", type=int, help="override the preset's number of training steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Read when torch loads (build_verifier imports it): on a CPU shared with other jobs, spinning OpenMP
    # threads made the tiny build 4x slower (380 s instead of 90 s); sleeping ones cost little.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    summary = build_verifier(
        args.output_dir, args.size, corpus_dir=args.corpus_dir, steps=args.steps, seed=args.seed
    )
    if summary["cached"]:
        print(f"toy verifier already built at {summary['path']} (same settings); nothing to do")
    else:
        print(
            f"toy verifier {args.size}: {summary['params'] / 1e6:.2f}M params, {summary['layers']} layers, "
            f"vocab {summary['vocab_size']}, loss {summary['initial_loss']:.2f} -> {summary['final_loss']:.2f}, "
            f"heldout loss {summary.get('heldout_loss', float('nan')):.2f} top-1 {summary.get('heldout_top1', 0):.2f}, "
            f"{summary['seconds']:.0f}s on {summary['device']} -> {summary['path']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
