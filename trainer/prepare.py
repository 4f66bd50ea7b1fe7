"""Tokenise a corpus, run the verifier once, and store what draft training needs, one file per sample.

    python -m trainer.prepare --verifier-path V --corpus FILE --output-dir D [--max-seq-len N]
        [--draft-vocab-size K] [--max-samples M] [--batch-size B] [--layer-ids 2,16,29]
        [--device auto|cuda:1|cpu] [--trust-remote-code] [--store-dtype bf16|fp8]

The verifier is spread over every GPU of the host (`--device auto`, the default with CUDA: accelerate's
`device_map="auto"`), so a verifier larger than one GPU prepares on one machine. Samples stream from the
corpus to disk; a relaunch into the same output dir with the same settings resumes, skipping the samples
already written completely (each is written under a temporary name and renamed into place).

Corpus formats (plain text, JSONL text records, chat messages or ShareGPT conversations): trainer/corpus.py.

Output under D:
- hidden_states/sample_000000.safetensors ...: `input_ids` int64 [S], `loss_mask` uint8 [S],
  `hidden_states` bf16 [S, 3H] (inputs of the three captured layers, concatenated in --layer-ids order),
  `last_hidden_state` bf16 [S, H] (output of the last decoder layer, before the final norm, so that
  `lm_head(norm(last_hidden_state))` are the verifier's logits), `verifier_top_ids` int32 [S] (the verifier's
  top-1 token at each position: with it the trainer multiplies only the draft vocabulary's rows of the head);
  with `--store-dtype fp8` both features are float8_e4m3fn and each has its float32 [S, 1] scale
  (`hidden_states_scale`, `last_hidden_state_scale`: one per token, as speculators' FP8 connector; see
  `trainer.data.quantize_fp8`), half the bytes on disk and on the way to the GPU;
- vocab_mapping/vocab_mapping.safetensors: the K most frequent tokens at loss-masked positions (trainer.vocab);
- prepare.settings.json: what the samples were made with (a relaunch with other settings starts over);
- prepare.json: metadata, written last.
"""

import argparse
import json
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging as hf_logging

from trainer.corpus import ReadProgress, iter_samples
from trainer.data import FP8_SCALES, quantize_fp8
from trainer.timefmt import duration
from trainer.verifier_model import (
    capture_hidden_states,
    default_layer_ids,
    layer_devices,
    load_verifier,
    verifier_dtype,
)
from trainer.vocab import build_vocab_mapping, save_vocab_mapping

SAMPLE_PATTERN = "sample_*.safetensors"
SETTINGS_FILE = "prepare.settings.json"
PREPARE_FORMAT = 1
WRITERS = 4  # threads writing sample files while the verifier computes the next batch
REPORT_SECONDS = 30  # between progress lines
STORE_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # --store-dtype: how the features are stored


def _save_sample(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    # Renamed into place so that a reader (or a resumed prepare) never sees a half-written sample.
    tmp.replace(path)


def _sample_path(sample_dir: Path, index: int) -> Path:
    return sample_dir / f"sample_{index:06d}.safetensors"


def _written_sample_matches(path: Path, ids: list[int]) -> bool:
    """Whether a complete sample for exactly these tokens is already on disk (a resumed prepare skips it)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor("input_ids").tolist() == ids
    except Exception:  # an unreadable file is written again
        return False


def _start_or_resume(output_dir: Path, sample_dir: Path, settings: dict) -> bool:
    """Keep the samples already written when they were made with the same settings; returns whether it resumes."""
    settings_path = output_dir / SETTINGS_FILE
    resume = settings_path.is_file() and json.loads(settings_path.read_text()) == settings
    sample_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "prepare.json").unlink(missing_ok=True)
    stale = list(sample_dir.glob("sample_*.tmp")) + ([] if resume else list(sample_dir.glob(SAMPLE_PATTERN)))
    for path in stale:
        path.unlink()
    settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    return resume


def _load(verifier_path: str | Path, device: str | None, trust_remote_code: bool) -> tuple:
    """(model, tokenizer, dtype): spread over every GPU by default, in `verifier_dtype`'s dtype."""
    device = device or ("auto" if torch.cuda.is_available() else "cpu")
    dtype = verifier_dtype(verifier_path, device if device != "auto" or torch.cuda.is_available() else "cpu")
    model, tokenizer = load_verifier(verifier_path, device, dtype, trust_remote_code)
    return model, tokenizer, dtype


def _checked_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    layer_ids = list(layer_ids) if layer_ids is not None else default_layer_ids(num_layers)
    if len(layer_ids) != 3 or not all(0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"--layer-ids needs three layer indices in [0, {num_layers}), got {layer_ids}")
    return layer_ids


def _fitting_draft_vocab(draft_vocab_size: int, vocab_size: int) -> int:
    if draft_vocab_size > vocab_size:
        print(
            f"prepare: draft vocab size {draft_vocab_size} > verifier vocab {vocab_size}; using {vocab_size}"
        )
    return min(draft_vocab_size, vocab_size)


def _stored(tensors: dict[str, torch.Tensor], store_dtype: str) -> dict[str, torch.Tensor]:
    if store_dtype == "bf16":
        return tensors
    for name, scale in FP8_SCALES.items():
        tensors[name], tensors[scale] = quantize_fp8(tensors[name])
    return tensors


def _capture(model, batch: list[tuple[Path, list[int], list[int]]], layer_ids: list[int],
             pad_id: int, store_dtype: str = "bf16") -> list[dict[str, torch.Tensor]]:
    """Each sample's tensors: its tokens and loss mask, and what the verifier computes on them (bf16, on the CPU)."""
    lengths = [len(ids) for _, ids, _ in batch]
    longest = max(lengths)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, (_, ids, _) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    input_device = model.get_input_embeddings().weight.device
    aux, last, top = capture_hidden_states(
        model, input_ids.to(input_device), attention_mask.to(input_device), layer_ids, top_ids=True
    )
    aux, last, top = aux.to(torch.bfloat16).cpu(), last.to(torch.bfloat16).cpu(), top.to(torch.int32).cpu()
    return [
        _stored({
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
            "hidden_states": aux[row, :length].clone(),
            "last_hidden_state": last[row, :length].clone(),
            "verifier_top_ids": top[row, :length].clone(),
        }, store_dtype)
        for row, ((_, ids, mask), length) in enumerate(zip(batch, lengths, strict=True))
    ]


class SampleWriter:
    """Writes sample files on a few threads; a bounded queue of writes lets the GPU keep working while the disk
    catches up, and keeps memory flat."""

    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self.pending: deque[Future] = deque()
        self.pool = ThreadPoolExecutor(max_workers=WRITERS)

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.append(self.pool.submit(_save_sample, path, tensors))
        while len(self.pending) > self.max_pending:
            self.pending.popleft().result()

    def __enter__(self) -> "SampleWriter":
        return self

    def __exit__(self, exc_type: type | None, *_) -> None:
        with self.pool:  # waits for every write; an error already raised is not hidden by a write's
            while exc_type is None and self.pending:
                self.pending.popleft().result()


@dataclass
class Written:
    """What the samples hold, counted as they stream; `counts[t]`: how often token t is a target."""

    counts: torch.Tensor
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    skipped: int = 0

    def report(self, started: float, done: float) -> None:
        """A progress line: counts, rate and, from `done` (the share of the work behind us), the ETA."""
        elapsed = time.monotonic() - started
        eta = f", ETA {duration(elapsed / done * (1 - done))}" if 0 < done < 1 else ""
        print(f"prepare: {self.samples} samples ({self.skipped} already written), {self.tokens} tokens, "
              f"{self.tokens / elapsed:.0f} tokens/s; {100 * done:.1f}% done after {duration(elapsed)}{eta}",
              flush=True)


def _write_samples(model, tokenizer, corpus: Path, sample_dir: Path, resume: bool, max_seq_len: int,
                   max_samples: int | None, batch_size: int, layer_ids: list[int], started: float,
                   store_dtype: str = "bf16") -> Written:
    """Stream the corpus's samples through the verifier to sample_dir, skipping those a resumed run already has."""
    vocab_size = model.config.get_text_config().vocab_size
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    written = Written(torch.zeros(vocab_size, dtype=torch.long))
    last_report = time.monotonic()
    progress = ReadProgress(corpus)

    def done() -> float:  # the corpus read so far, or the samples asked for, whichever is further
        return max(progress.fraction, written.samples / max_samples if max_samples else 0.0)

    with SampleWriter(max_pending=4 * batch_size) as writer:

        def run_batch(batch: list[tuple[Path, list[int], list[int]]]) -> None:
            for (path, _, _), tensors in zip(batch, _capture(model, batch, layer_ids, pad_id, store_dtype), strict=True):
                writer.write(path, tensors)

        batch: list[tuple[Path, list[int], list[int]]] = []
        for ids, mask in iter_samples(tokenizer, corpus, max_seq_len, progress):
            if max_samples is not None and written.samples >= max_samples:
                break
            if max(ids) >= vocab_size:
                raise ValueError(f"tokenizer produced id {max(ids)} >= the model's vocab size {vocab_size}")
            targets = torch.tensor(ids)[torch.tensor(mask, dtype=torch.bool)]
            written.counts.index_add_(0, targets, torch.ones_like(targets))  # no vocab-sized temporary per sample
            path = _sample_path(sample_dir, written.samples)
            written.samples += 1
            written.tokens += len(ids)
            written.loss_tokens += targets.numel()
            if resume and _written_sample_matches(path, ids):
                written.skipped += 1
                continue
            batch.append((path, ids, mask))
            if len(batch) == batch_size:
                run_batch(batch)
                batch = []
                if time.monotonic() - last_report > REPORT_SECONDS:
                    last_report = time.monotonic()
                    written.report(started, done())
        if batch:
            run_batch(batch)
    return written


def _drop_surplus(sample_dir: Path, num_samples: int) -> None:
    """Remove samples left by an earlier run with a larger --max-samples."""
    for surplus in sample_dir.glob(SAMPLE_PATTERN):
        if int(surplus.stem.split("_")[1]) >= num_samples:
            surplus.unlink()


def _save_draft_vocab(output_dir: Path, written: Written, vocab_size: int, draft_vocab_size: int) -> float:
    """Save the draft vocabulary (the most frequent targets); returns the share of targets it covers."""
    counts = written.counts
    d2t, t2d = build_vocab_mapping(
        {int(i): int(counts[i]) for i in counts.nonzero().flatten()}, vocab_size, draft_vocab_size
    )
    save_vocab_mapping(output_dir / "vocab_mapping", d2t, t2d)
    return round(int(counts[t2d].sum()) / max(1, written.loss_tokens), 6)


def prepare(
    verifier_path: str | Path,
    corpus: str | Path,
    output_dir: str | Path,
    max_seq_len: int = 2048,
    draft_vocab_size: int = 32000,
    max_samples: int | None = None,
    batch_size: int = 8,
    layer_ids: Sequence[int] | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    store_dtype: str = "bf16",
) -> dict:
    """Write D/hidden_states/, D/vocab_mapping/ and D/prepare.json; returns the metadata written.

    Samples stream from the corpus through the verifier to disk; only a few batches are in memory at once.
    A relaunch with the same verifier, corpus and settings resumes: samples already written completely
    (checked by their tokens) are skipped, the others are computed.
    """
    started = time.monotonic()
    corpus, output_dir = Path(corpus), Path(output_dir)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} does not exist")
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype {store_dtype!r}: expected one of {', '.join(STORE_DTYPES)}")
    model, tokenizer, model_dtype = _load(verifier_path, device, trust_remote_code)
    config = model.config.get_text_config()
    num_layers, hidden_size, vocab_size = config.num_hidden_layers, config.hidden_size, config.vocab_size
    layer_ids = _checked_layer_ids(layer_ids, num_layers)
    draft_vocab_size = _fitting_draft_vocab(draft_vocab_size, vocab_size)
    sample_dir = output_dir / "hidden_states"
    settings = {"verifier_path": str(Path(verifier_path).resolve()), "corpus": str(corpus.resolve()),
                "corpus_bytes": corpus.stat().st_size, "max_seq_len": max_seq_len, "layer_ids": layer_ids,
                "dtype": str(model_dtype), **({"store_dtype": store_dtype} if store_dtype != "bf16" else {})}
    resume = _start_or_resume(output_dir, sample_dir, settings)
    written = _write_samples(model, tokenizer, corpus, sample_dir, resume, max_seq_len, max_samples, batch_size,
                             layer_ids, started, store_dtype)
    if written.samples == 0:
        raise ValueError(f"no samples in {corpus}: it is empty, or no record has an assistant turn to train on")
    _drop_surplus(sample_dir, written.samples)
    note = storage_note(sample_dir, hidden_size, store_dtype, torch.cuda.device_count())
    if note:
        print(note, flush=True)
    metadata = {
        "format": PREPARE_FORMAT,
        "verifier_path": settings["verifier_path"],
        "corpus": settings["corpus"],
        "layer_ids": layer_ids,
        "num_hidden_layers": num_layers,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "draft_vocab_coverage": _save_draft_vocab(output_dir, written, vocab_size, draft_vocab_size),
        "max_seq_len": max_seq_len,
        "num_samples": written.samples,
        "num_tokens": written.tokens,
        "num_loss_tokens": written.loss_tokens,
        "resumed_samples": written.skipped,
        "layer_devices": layer_devices(model),
        "chat_template": "tokenizer" if tokenizer.chat_template else "fallback",
        "dtype": STORE_DTYPES[store_dtype],
        "seconds": round(time.monotonic() - started, 1),
    }
    tmp = output_dir / "prepare.json.tmp"
    tmp.write_text(json.dumps(metadata, indent=2) + "\n")
    tmp.replace(output_dir / "prepare.json")
    return metadata


# An H200's in-memory training step at 2048 tokens x TTT 3 (benchmarks/bench_trainer.py, docs/benchmarks.md): 75,000
# tokens/s at hidden 4096 (27.3 ms a step), 36,500 at 7168 (56.1 ms); tokens/s ~ H^-1.3 through both. Below
# MEASURED_FROM_HIDDEN the draft is too small for that rule to say anything.
H200_TOKENS_PER_S, H200_AT_HIDDEN, H200_EXPONENT, MEASURED_FROM_HIDDEN = 75_000, 4096, 1.3, 2048
READ_CHECK_FILES, READ_CHECK_BYTES, READ_CHECK_READERS = 16, 1 << 30, 4


def expected_tokens_per_s(hidden_size: int, gpus: int) -> float | None:
    """About how many tokens a second `gpus` H200s train the draft of a verifier this wide (None: too small to say)."""
    if hidden_size < MEASURED_FROM_HIDDEN:
        return None
    return max(1, gpus) * H200_TOKENS_PER_S * (H200_AT_HIDDEN / hidden_size) ** H200_EXPONENT


def cold_read_rate(files: Sequence[Path], readers: int = READ_CHECK_READERS) -> tuple[float, bool]:
    """(bytes/s, whether from a cold cache) of reading these files whole with `readers` threads, as the trainer's
    loader does; each is flushed and dropped from the page cache first where the system allows it."""
    cold = hasattr(os, "posix_fadvise")
    for path in files:
        with open(path, "rb+") as file:
            if cold:
                os.fdatasync(file.fileno())
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def read(path: Path) -> int:
        with open(path, "rb", buffering=0) as file:
            return sum(iter(lambda: len(file.read(1 << 24)), 0))

    started = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(read, files))
    return total / max(time.perf_counter() - started, 1e-9), cold


def storage_note(sample_dir: Path, hidden_size: int, store_dtype: str, gpus: int,
                 train_tokens_per_s: float | None = None, read_rate: tuple[float, bool] | None = None) -> str | None:
    """The line that says the disk will be the training's bound and FP8 storage halves the bytes, with its figures:
    bf16 samples whose bytes a token, at the read rate measured here (`read_rate`, else `cold_read_rate` of the last
    samples written), give fewer tokens a second than `gpus` train (`train_tokens_per_s`, else the expected rate).
    None when the samples are FP8 already, the disk keeps up, or there is no rate to compare with."""
    expected = train_tokens_per_s or expected_tokens_per_s(hidden_size, gpus)
    files = sorted(sample_dir.glob(SAMPLE_PATTERN))[-READ_CHECK_FILES:]
    if store_dtype != "bf16" or expected is None or not files:
        return None
    while len(files) > 1 and sum(f.stat().st_size for f in files) > READ_CHECK_BYTES:
        files = files[1:]
    with safe_open(str(files[-1]), "pt") as sample:
        tokens = sample.get_slice("input_ids").get_shape()[0]
    per_token = files[-1].stat().st_size / max(tokens, 1)
    rate, cold = read_rate or cold_read_rate(files)
    from_disk = rate / per_token
    if from_disk >= expected:
        return None
    fp8_per_token = per_token - 4 * hidden_size + 8  # 4H + 8 feature bytes a token against 8H
    basis = ("given" if train_tokens_per_s else f"an H200's step at hidden {hidden_size}, x{max(1, gpus)} GPU(s)")
    return (f"prepare: reads will bound training: bf16 samples are {per_token / 1e3:.1f} KB a token and this disk read "
            f"{rate / 1e9:.2f} GB/s{' cold' if cold else ''} ({len(files)} file{'s' if len(files) > 1 else ''}, {READ_CHECK_READERS} readers), "
            f"{from_disk / 1e3:.1f}k tokens/s, where training takes about {expected / 1e3:.1f}k tokens/s ({basis}), "
            f"{expected * per_token / 1e9:.2f} GB/s; --store-dtype fp8 halves the feature bytes "
            f"({fp8_per_token / 1e3:.1f} KB a token, {rate / fp8_per_token / 1e3:.1f}k tokens/s from this disk)")


def _layer_ids(value: str) -> list[int]:
    return [int(part) for part in value.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verifier-path", required=True, help="Hugging Face causal LM directory")
    parser.add_argument("--corpus", required=True, type=Path, help="plain text, or JSONL with text/messages")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--draft-vocab-size", type=int, default=32000)
    parser.add_argument("--max-samples", type=int)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--layer-ids", type=_layer_ids, help="three comma-separated layer indices (default 2,N//2,N-3)"
    )
    parser.add_argument(
        "--device", help="auto (spread over every GPU), cuda:1, cpu (default: auto when CUDA is available, else cpu)"
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the verifier's own modelling/tokenizer code"
    )
    parser.add_argument("--store-dtype", choices=tuple(STORE_DTYPES), default="bf16",
                        help="fp8: features as float8_e4m3fn with a scale per token, half the bytes")
    parser.add_argument("--regenerate", action="store_true",
                        help="first replace the responses with the verifier's own (D/regenerated.jsonl, resumable)")
    parser.add_argument("--regen-temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--regen-batch-size", type=int, default=32)
    parser.add_argument("--regen-max-new-tokens", type=int, help="default: up to max-seq-len")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    if args.regenerate:
        from trainer.regenerate import regenerate_corpus

        args.corpus = regenerate_corpus(
            args.verifier_path, args.corpus, args.output_dir, args.max_seq_len, args.max_samples,
            args.regen_temperature, args.regen_batch_size, args.regen_max_new_tokens,
            [args.device] if args.device else None, trust_remote_code=args.trust_remote_code)
    metadata = prepare(
        args.verifier_path,
        args.corpus,
        args.output_dir,
        max_seq_len=args.max_seq_len,
        draft_vocab_size=args.draft_vocab_size,
        max_samples=args.max_samples,
        batch_size=args.batch_size,
        layer_ids=args.layer_ids,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        store_dtype=args.store_dtype,
    )
    print(
        f"prepare: {metadata['num_samples']} samples, {metadata['num_tokens']} tokens "
        f"({metadata['num_loss_tokens']} with loss; {metadata['resumed_samples']} already written), layers {metadata['layer_ids']}, draft vocab "
        f"{metadata['draft_vocab_size']} covering {metadata['draft_vocab_coverage']:.1%}, "
        f"{metadata['seconds']:.0f}s -> {args.output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
