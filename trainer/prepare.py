"""Tokenise a corpus, run the verifier once, and store what draft training needs, one file per sample.

    python -m trainer.prepare --verifier-path V --corpus FILE --output-dir D [--max-seq-len N]
        [--draft-vocab-size K] [--max-samples M] [--batch-size B] [--layer-ids 2,16,29]
        [--device auto|cuda:1|cpu] [--trust-remote-code]

The verifier is spread over every GPU of the host (`--device auto`, the default with CUDA: accelerate's
`device_map="auto"`), so a verifier larger than one GPU prepares on one machine. Samples stream from the
corpus to disk; a relaunch into the same output dir with the same settings resumes, skipping the samples
already written completely (each is written under a temporary name and renamed into place).

Corpus formats (a `.jsonl` / `.json` file is JSONL, anything else plain text):
- plain text: one token stream cut into chunks of max-seq-len tokens; every token is a target.
- JSONL `{"text": ...}`: each record on its own, EOS appended, cut into chunks; every token is a target.
- JSONL `{"messages": [{"role", "content"}, ...]}` (or ShareGPT `{"conversations": [{"from", "value"}]}`):
  one sample per record, truncated to max-seq-len; only assistant turns are targets (loss_mask 1), from the
  first token of the reply through its end-of-turn marker. Rendered with the tokenizer's chat template, or
  FALLBACK_CHAT_TEMPLATE (ChatML) when it has none.

Output under D:
- hidden_states/sample_000000.safetensors ...: `input_ids` int64 [S], `loss_mask` uint8 [S],
  `hidden_states` bf16 [S, 3H] (inputs of the three captured layers, concatenated in --layer-ids order),
  `last_hidden_state` bf16 [S, H] (output of the last decoder layer, before the final norm, so that
  `lm_head(norm(last_hidden_state))` are the verifier's logits), `verifier_top_ids` int32 [S] (the verifier's
  top-1 token at each position: with it the trainer multiplies only the draft vocabulary's rows of the head);
- vocab_mapping/vocab_mapping.safetensors: the K most frequent tokens at loss-masked positions (trainer.vocab);
- prepare.settings.json: what the samples were made with (a relaunch with other settings starts over);
- prepare.json: metadata, written last.
"""

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging as hf_logging

from trainer.verifier_model import capture_hidden_states, default_layer_ids, layer_devices, load_verifier
from trainer.vocab import build_vocab_mapping, save_vocab_mapping

SAMPLE_PATTERN = "sample_*.safetensors"
SETTINGS_FILE = "prepare.settings.json"
PREPARE_FORMAT = 1
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
MIN_CHUNK_TOKENS = 8  # a shorter tail of a text stream is dropped: too little context to train on
TEXT_PIECE_CHARS = 1 << 20  # plain text is tokenised in pieces of about this size, cut at line ends


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def _chunks(
    ids: list[int], max_seq_len: int, bos: int | None, final: bool
) -> tuple[list[list[int]], list[int]]:
    """Cut full chunks off `ids` (each led by `bos` when given); returns (chunks, rest)."""
    body = max_seq_len - (bos is not None)
    prefix = [bos] if bos is not None else []
    chunks = []
    start = 0
    while len(ids) - start >= body:
        chunks.append(prefix + ids[start : start + body])
        start += body
    rest = ids[start:]
    if final and len(prefix) + len(rest) >= MIN_CHUNK_TOKENS:
        chunks.append(prefix + rest)
        rest = []
    return chunks, rest


def _text_pieces(path: Path) -> Iterator[str]:
    piece: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= TEXT_PIECE_CHARS:
                yield "".join(piece)
                piece, size = [], 0
    if piece:
        yield "".join(piece)


def tokenize_text_stream(
    tokenizer, path: Path, max_seq_len: int, bos: int | None
) -> Iterator[tuple[list[int], list[int]]]:
    """Plain text file -> chunks of max_seq_len tokens (led by `bos` if given), memory bounded by one piece."""
    buffer: list[int] = []
    for piece in _text_pieces(path):
        buffer.extend(tokenizer(piece, add_special_tokens=False, verbose=False).input_ids)
        chunks, buffer = _chunks(buffer, max_seq_len, bos, final=False)
        for chunk in chunks:
            yield chunk, [1] * len(chunk)
    chunks, _ = _chunks(buffer, max_seq_len, bos, final=True)
    for chunk in chunks:
        yield chunk, [1] * len(chunk)


def tokenize_text_record(
    tokenizer, text: str, max_seq_len: int, bos: int | None
) -> list[tuple[list[int], list[int]]]:
    ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    chunks, _ = _chunks(ids, max_seq_len, bos, final=True)
    return [(chunk, [1] * len(chunk)) for chunk in chunks]


def _render(tokenizer, messages: list[dict], template: str | None, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return the text and the character spans of the assistant replies.

    A reply's span runs from the end of the prompt rendered up to it (with the generation prompt) to the
    end of the conversation rendered through it, so it includes the end-of-turn marker. Templates for which
    those renderings are not prefixes of the whole (some drop earlier reasoning) fall back to the reply text.
    """
    template = None if tokenizer.chat_template else FALLBACK_CHAT_TEMPLATE
    text = _render(tokenizer, messages, template, add_generation_prompt=False)
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], template, add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], template, add_generation_prompt=False)
        if text.startswith(before) and text.startswith(through) and len(before) < len(through):
            start, end = len(before), len(through)
        else:
            content = str(message.get("content") or "")
            start = text.find(content, cursor)
            if not content or start < 0:
                continue
            end = start + len(content)
        spans.append((start, end))
        cursor = end
    return text, spans


def tokenize_chat(tokenizer, messages: list[dict], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant-reply tokens) of one conversation, truncated."""
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    char_mask = bytearray(len(text) + 1)
    for start, end in spans:
        char_mask[start:end] = b"\x01" * (end - start)
    mask = [int(end > start and any(char_mask[start:end])) for start, end in encoding["offset_mapping"]]
    return encoding["input_ids"][:max_seq_len], mask[:max_seq_len]


def _normalise_messages(record: dict) -> list[dict] | None:
    if "messages" in record:
        return record["messages"]
    if "conversations" in record:
        return [
            {"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": turn["value"]}
            for turn in record["conversations"]
        ]
    return None


def iter_samples(tokenizer, corpus: Path, max_seq_len: int) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every sample in the corpus, in file order; samples without targets skipped."""
    # Chunks of plain text start with BOS exactly when the tokenizer would add one to a document.
    bos = tokenizer.bos_token_id if _adds_bos(tokenizer) else None
    if corpus.suffix not in (".jsonl", ".json"):
        yield from tokenize_text_stream(tokenizer, corpus, max_seq_len, bos)
        return
    with open(corpus, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{corpus}:{line_number}: not valid JSON ({error})") from None
            messages = _normalise_messages(record)
            if messages is not None:
                ids, mask = tokenize_chat(tokenizer, messages, max_seq_len)
                if any(mask):
                    yield ids, mask
            elif "text" in record:
                yield from tokenize_text_record(tokenizer, record["text"], max_seq_len, bos)
            else:
                raise ValueError(
                    f"{corpus}:{line_number}: a record needs a 'text', 'messages' or 'conversations' field; "
                    f"found {sorted(record)}"
                )


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
    device = device or ("auto" if torch.cuda.is_available() else "cpu")
    # bf16 on GPU as in serving; fp32 on CPU, where bf16 matmuls are slow and the features are cast anyway.
    model_dtype = torch.bfloat16 if device != "cpu" and torch.cuda.is_available() else torch.float32
    model, tokenizer = load_verifier(verifier_path, device, model_dtype, trust_remote_code)
    config = model.config.get_text_config()
    num_layers, hidden_size, vocab_size = config.num_hidden_layers, config.hidden_size, config.vocab_size
    layer_ids = list(layer_ids) if layer_ids is not None else default_layer_ids(num_layers)
    if len(layer_ids) != 3 or not all(0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"--layer-ids needs three layer indices in [0, {num_layers}), got {layer_ids}")
    if draft_vocab_size > vocab_size:
        print(
            f"prepare: draft vocab size {draft_vocab_size} > verifier vocab {vocab_size}; using {vocab_size}"
        )
        draft_vocab_size = vocab_size
    input_device = model.get_input_embeddings().weight.device

    sample_dir = output_dir / "hidden_states"
    settings = {
        "verifier_path": str(Path(verifier_path).resolve()),
        "corpus": str(corpus.resolve()),
        "corpus_bytes": corpus.stat().st_size,
        "max_seq_len": max_seq_len,
        "layer_ids": layer_ids,
        "dtype": str(model_dtype),
    }
    resume = _start_or_resume(output_dir, sample_dir, settings)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    counts = torch.zeros(vocab_size, dtype=torch.long)
    stats = {"samples": 0, "tokens": 0, "loss_tokens": 0, "skipped": 0}
    pending: deque[Future] = deque()
    last_report = time.monotonic()

    def run_batch(batch: list[tuple[Path, list[int], list[int]]], writer: ThreadPoolExecutor) -> None:
        lengths = [len(ids) for _, ids, _ in batch]
        longest = max(lengths)
        input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, (_, ids, _) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        aux, last, top = capture_hidden_states(
            model, input_ids.to(input_device), attention_mask.to(input_device), layer_ids, top_ids=True
        )
        aux, last, top = aux.to(torch.bfloat16).cpu(), last.to(torch.bfloat16).cpu(), top.to(torch.int32).cpu()
        for row, ((path, ids, mask), length) in enumerate(zip(batch, lengths, strict=True)):
            tensors = {
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                "hidden_states": aux[row, :length].clone(),
                "last_hidden_state": last[row, :length].clone(),
                "verifier_top_ids": top[row, :length].clone(),
            }
            pending.append(writer.submit(_save_sample, path, tensors))
        # Bounded queue of writes: the GPU keeps working while the disk catches up, memory stays flat.
        while len(pending) > 4 * batch_size:
            pending.popleft().result()

    with ThreadPoolExecutor(max_workers=4) as writer:
        batch: list[tuple[Path, list[int], list[int]]] = []
        for ids, mask in iter_samples(tokenizer, corpus, max_seq_len):
            if max_samples is not None and stats["samples"] >= max_samples:
                break
            if max(ids) >= vocab_size:
                raise ValueError(f"tokenizer produced id {max(ids)} >= the model's vocab size {vocab_size}")
            targets = torch.tensor(ids)[torch.tensor(mask, dtype=torch.bool)]
            counts.index_add_(0, targets, torch.ones_like(targets))  # no vocab-sized temporary per sample
            path = _sample_path(sample_dir, stats["samples"])
            stats["samples"] += 1
            stats["tokens"] += len(ids)
            stats["loss_tokens"] += targets.numel()
            if resume and _written_sample_matches(path, ids):
                stats["skipped"] += 1
                continue
            batch.append((path, ids, mask))
            if len(batch) == batch_size:
                run_batch(batch, writer)
                batch = []
                if time.monotonic() - last_report > 30:
                    last_report = time.monotonic()
                    rate = stats["tokens"] / (last_report - started)
                    print(
                        f"prepare: {stats['samples']} samples ({stats['skipped']} already written), "
                        f"{stats['tokens']} tokens, {rate:.0f} tokens/s",
                        flush=True,
                    )
        if batch:
            run_batch(batch, writer)
        while pending:
            pending.popleft().result()
    if stats["samples"] == 0:
        raise ValueError(
            f"no samples in {corpus}: it is empty, or no record has an assistant turn to train on"
        )
    for surplus in sample_dir.glob(SAMPLE_PATTERN):  # left by an earlier run with a larger --max-samples
        if int(surplus.stem.split("_")[1]) >= stats["samples"]:
            surplus.unlink()

    d2t, t2d = build_vocab_mapping(
        {int(i): int(counts[i]) for i in counts.nonzero().flatten()}, vocab_size, draft_vocab_size
    )
    save_vocab_mapping(output_dir / "vocab_mapping", d2t, t2d)
    covered = int(counts[t2d].sum())
    metadata = {
        "format": PREPARE_FORMAT,
        "verifier_path": settings["verifier_path"],
        "corpus": settings["corpus"],
        "layer_ids": layer_ids,
        "num_hidden_layers": num_layers,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "draft_vocab_coverage": round(covered / max(1, stats["loss_tokens"]), 6),
        "max_seq_len": max_seq_len,
        "num_samples": stats["samples"],
        "num_tokens": stats["tokens"],
        "num_loss_tokens": stats["loss_tokens"],
        "resumed_samples": stats["skipped"],
        "layer_devices": layer_devices(model),
        "chat_template": "tokenizer" if tokenizer.chat_template else "fallback",
        "dtype": "bfloat16",
        "seconds": round(time.monotonic() - started, 1),
    }
    tmp = output_dir / "prepare.json.tmp"
    tmp.write_text(json.dumps(metadata, indent=2) + "\n")
    tmp.replace(output_dir / "prepare.json")
    return metadata


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
