"""Reading a training corpus: its records, their tokens, and the chat template they are rendered with.

`prepare` (the features to train on), `regenerate` (the verifier's own responses) and `evaluate` (the prompts)
read a corpus through this module, so the three see the same samples in the same order.

Corpus formats (a `.jsonl` / `.json` file is JSONL, anything else plain text):
- plain text: one token stream cut into chunks of max-seq-len tokens; every token is a target.
- JSONL `{"text": ...}`: each record on its own, EOS appended, cut into chunks; every token is a target.
- JSONL `{"messages": [{"role", "content"}, ...]}` (or ShareGPT `{"conversations": [{"from", "value"}]}`):
  one sample per record, truncated to max-seq-len; only assistant turns are targets (loss_mask 1), from the
  first token of the reply through its end-of-turn marker. Rendered with the tokenizer's chat template, or
  FALLBACK_CHAT_TEMPLATE (ChatML) when it has none.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class TextChunk:
    """max-seq-len tokens (or fewer, at the end of a text) of plain text; every token is a target."""

    ids: list[int]


@dataclass(frozen=True)
class Conversation:
    """A chat record's messages, roles normalised to user / assistant / system."""

    messages: list[dict]


def is_jsonl(corpus: Path) -> bool:
    return corpus.suffix in (".jsonl", ".json")


def adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def document_bos(tokenizer) -> int | None:
    """The token that leads each chunk of plain text: BOS exactly when the tokenizer would add one to a document."""
    return tokenizer.bos_token_id if adds_bos(tokenizer) else None


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


class ReadProgress:
    """How much of the corpus has been read, in bytes: prepare's total and ETA on a corpus it streams."""

    def __init__(self, path: Path):
        self.total = path.stat().st_size
        self.done = 0

    def advance(self, line: str) -> None:
        self.done += len(line.encode("utf-8", "replace"))

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0


def _text_pieces(path: Path, progress: ReadProgress | None = None) -> Iterator[str]:
    piece: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if progress is not None:
                progress.advance(line)
            piece.append(line)
            size += len(line)
            if size >= TEXT_PIECE_CHARS:
                yield "".join(piece)
                piece, size = [], 0
    if piece:
        yield "".join(piece)


def tokenize_text_stream(
    tokenizer, path: Path, max_seq_len: int, bos: int | None, progress: ReadProgress | None = None
) -> Iterator[tuple[list[int], list[int]]]:
    """Plain text file -> chunks of max_seq_len tokens (led by `bos` if given), memory bounded by one piece."""
    buffer: list[int] = []
    for piece in _text_pieces(path, progress):
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


def chat_template(tokenizer) -> str | None:
    """The template to render with: None (the tokenizer's own) or, when it has none, the ChatML fallback."""
    return None if tokenizer.chat_template else FALLBACK_CHAT_TEMPLATE


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template(tokenizer), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return the text and the character spans of the assistant replies.

    A reply's span runs from the end of the prompt rendered up to it (with the generation prompt) to the
    end of the conversation rendered through it, so it includes the end-of-turn marker. Templates for which
    those renderings are not prefixes of the whole (some drop earlier reasoning) fall back to the reply text.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
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


def read_corpus(tokenizer, corpus: Path, max_seq_len: int,
                progress: ReadProgress | None = None) -> Iterator[TextChunk | Conversation]:
    """The corpus in file order: plain text as chunks of tokens, chat records as conversations; `progress`
    counts the bytes read."""
    bos = document_bos(tokenizer)
    if not is_jsonl(corpus):
        for ids, _ in tokenize_text_stream(tokenizer, corpus, max_seq_len, bos, progress):
            yield TextChunk(ids)
        return
    with open(corpus, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if progress is not None:
                progress.advance(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{corpus}:{line_number}: not valid JSON ({error})") from None
            messages = _normalise_messages(record)
            if messages is not None:
                yield Conversation(messages)
            elif "text" in record:
                for ids, _ in tokenize_text_record(tokenizer, record["text"], max_seq_len, bos):
                    yield TextChunk(ids)
            else:
                raise ValueError(
                    f"{corpus}:{line_number}: a record needs a 'text', 'messages' or 'conversations' field; "
                    f"found {sorted(record)}"
                )


def iter_samples(tokenizer, corpus: Path, max_seq_len: int,
                 progress: ReadProgress | None = None) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every sample in the corpus, in file order; samples without targets skipped."""
    for item in read_corpus(tokenizer, corpus, max_seq_len, progress):
        if isinstance(item, TextChunk):
            yield item.ids, [1] * len(item.ids)
            continue
        ids, mask = tokenize_chat(tokenizer, item.messages, max_seq_len)
        if any(mask):
            yield ids, mask
