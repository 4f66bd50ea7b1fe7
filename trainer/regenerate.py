"""Regenerate a corpus's responses with the verifier itself, as the EAGLE-3 recipe does.

    python -m trainer.prepare ... --regenerate [--regen-temperature 0] [--regen-batch-size 32]
        [--regen-max-new-tokens N]

A draft is scored on the verifier's own (greedy) text, so it is trained on it. Samples, in prepare's order:
- plain text, and every chunk of a JSONL `text` record: the chunk of max-seq-len tokens prepare would
  make; its first half is kept as the prompt and the rest replaced by the verifier's continuation
  (up to the end of the chunk, or N new tokens). Written as `{"index": i, "text": prompt + continuation}`.
- chat `messages` (or ShareGPT `conversations`): every assistant turn replaced by the verifier's reply to
  the conversation before it (earlier turns already regenerated). Written as `{"index": i, "messages": [...]}`.

Output: D/regenerated.jsonl, one record per source sample index, in index order, appended batch by batch,
and D/regenerate.json with the settings. A relaunch with the same settings keeps the complete records and
regenerates the rest (a partially written last line is dropped); other settings start over.
Generation is batched (left padding, attention mask), one process per GPU of the host (CUDA_VISIBLE_DEVICES
picks them), or in this process on the CPU. Temperature 0 is greedy; above 0 it samples the full
distribution (no top-k or top-p), seeded per batch.
"""

import itertools
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel

from trainer.corpus import TextChunk, adds_bos, read_corpus, render_chat
from trainer.timefmt import duration
from trainer.verifier_model import load_verifier, verifier_dtype

REGENERATED_FILE = "regenerated.jsonl"
SETTINGS_FILE = "regenerate.json"
PROMPT_FRACTION = 0.5  # of a text chunk kept as the prompt, as in the issue-13 measurement

# generate(prompts, max_new_tokens per prompt, seed) -> new tokens per prompt, cut before the first stop token
Generate = Callable[[list[list[int]], list[int], int], list[list[int]]]


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: list[int], temperature: float,
    stop_ids: Sequence[int], pad_id: int, seed: int,
) -> list[list[int]]:
    """The verifier's continuations of `prompts` in one left-padded batch; each cut before its first stop token."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=max(max_new_tokens),
        eos_token_id=list(stop_ids), pad_token_id=pad_id, **sampling,
    )
    continuations = []
    for row, limit in enumerate(max_new_tokens):
        new = out[row, width : width + limit].tolist()
        stop = next((i for i, token in enumerate(new) if token in stop_ids), len(new))
        continuations.append(new[:stop])
    return continuations


@dataclass
class TextSample:
    """A chunk of text: its first part kept, the rest to be regenerated."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    continuation: list[int] | None = None

    def next_prompt(self) -> tuple[list[int], int] | None:
        return (self.prompt, self.max_new_tokens) if self.continuation is None else None

    def accept(self, generated: list[int]) -> None:
        self.continuation = generated

    def record(self, tokenizer) -> dict:
        body = self.prompt[1:] if self.prompt[:1] == [tokenizer.bos_token_id] and adds_bos(tokenizer) else self.prompt
        return {"index": self.index, "text": tokenizer.decode(body + self.continuation)}


@dataclass
class ChatSample:
    """A conversation whose assistant turns are regenerated one after another."""

    index: int
    messages: list[dict]
    tokenizer: object
    max_seq_len: int
    max_new_tokens: int | None
    turn: int = -1  # the assistant turn being regenerated
    remaining: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [dict(m) for m in self.messages]
        self.remaining = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    def next_prompt(self) -> tuple[list[int], int] | None:
        while self.remaining:
            self.turn = self.remaining.pop(0)
            text = render_chat(self.tokenizer, self.messages[: self.turn], add_generation_prompt=True)
            prompt = self.tokenizer(text, add_special_tokens=False, verbose=False).input_ids
            room = self.max_seq_len - len(prompt)
            if room > 0:  # a turn past max-seq-len is truncated away by prepare: left as written
                return prompt, min(room, self.max_new_tokens or room)
        return None

    def accept(self, generated: list[int]) -> None:
        self.messages[self.turn]["content"] = self.tokenizer.decode(generated, skip_special_tokens=True)

    def record(self, tokenizer) -> dict:
        return {"index": self.index, "messages": self.messages}


def iter_regeneration_samples(
    tokenizer, corpus: Path, max_seq_len: int, max_new_tokens: int | None
) -> Iterator[TextSample | ChatSample]:
    """The corpus's samples in prepare's order, each with what is kept and what is regenerated."""
    index = 0
    for item in read_corpus(tokenizer, corpus, max_seq_len):
        if isinstance(item, TextChunk):
            keep = max(1, int(len(item.ids) * PROMPT_FRACTION))
            room = max(1, max_seq_len - keep - 1)  # one place for the EOS prepare appends to a text record
            yield TextSample(index, item.ids[:keep], min(room, max_new_tokens or room))
            index += 1
        elif any(m["role"] == "assistant" for m in item.messages):
            yield ChatSample(index, item.messages, tokenizer, max_seq_len, max_new_tokens)
            index += 1


def regenerate_samples(samples: list[TextSample | ChatSample], generate: Generate, seed: int) -> None:
    """Fill in every sample's regenerated parts: one batched generation per round of turns."""
    for round_number in itertools.count():
        asks = [(sample, sample.next_prompt()) for sample in samples]
        asks = [(sample, ask) for sample, ask in asks if ask is not None]
        if not asks:
            return
        prompts, limits = [ask[0] for _, ask in asks], [ask[1] for _, ask in asks]
        for (sample, _), generated in zip(asks, generate(prompts, limits, seed + round_number), strict=True):
            sample.accept(generated)


def read_done(path: Path) -> set[int]:
    """Indices of the complete records in `path`; a partially written last line is cut off the file."""
    if not path.exists():
        return set()
    done, good_bytes = set(), 0
    with open(path, "rb") as f:
        for line in f:
            try:
                index = json.loads(line)["index"]
            except (ValueError, KeyError):
                break
            if not line.endswith(b"\n"):
                break
            done.add(index)
            good_bytes += len(line)
    os.truncate(path, good_bytes)
    return done


def stop_token_ids(model: PreTrainedModel, tokenizer) -> list[int]:
    """EOS ids of the tokenizer and the generation config, and ChatML's end of turn when it is one token."""
    ids = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    return sorted(i for i in ids if i is not None)


def default_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]


_worker: dict = {}




def _load_worker(verifier_path: str, devices: "multiprocessing.Queue", temperature: float,
                 trust_remote_code: bool) -> None:
    device = devices.get()
    model, tokenizer = load_verifier(verifier_path, torch.device(device), verifier_dtype(verifier_path, device), trust_remote_code)
    _worker.update(model=model, stop=stop_token_ids(model, tokenizer), pad=_pad_id(tokenizer),
                   temperature=temperature)


def _generate_in_worker(prompts: list[list[int]], limits: list[int], seed: int) -> list[list[int]]:
    w = _worker
    return generate_batch(w["model"], prompts, limits, w["temperature"], w["stop"], w["pad"], seed)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0


def start_generators(
    verifier_path: str | Path, devices: Sequence[str], temperature: float, trust_remote_code: bool = False,
) -> tuple[Generate, object, Callable[[], None]]:
    """(generate, tokenizer, close): in this process for one device (or "auto": one copy spread over every GPU,
    for a verifier too large for one), else one spawned process per device."""
    if len(devices) == 1:
        device = devices[0] if devices[0] == "auto" else torch.device(devices[0])
        model, tokenizer = load_verifier(verifier_path, device, verifier_dtype(verifier_path, device), trust_remote_code)
        stop, pad = stop_token_ids(model, tokenizer), _pad_id(tokenizer)

        def generate_here(prompts: list[list[int]], limits: list[int], seed: int) -> list[list[int]]:
            return generate_batch(model, prompts, limits, temperature, stop, pad, seed)

        return generate_here, tokenizer, lambda: None
    spawn = multiprocessing.get_context("spawn")
    device_queue = spawn.Queue()
    for device in devices:
        device_queue.put(device)
    pool = ProcessPoolExecutor(len(devices), mp_context=spawn, initializer=_load_worker,
                               initargs=(str(verifier_path), device_queue, temperature, trust_remote_code))

    def generate_in_pool(prompts: list[list[int]], limits: list[int], seed: int) -> list[list[int]]:
        return pool.submit(_generate_in_worker, prompts, limits, seed).result()

    tokenizer = AutoTokenizer.from_pretrained(str(verifier_path), trust_remote_code=trust_remote_code)
    return generate_in_pool, tokenizer, lambda: pool.shutdown(cancel_futures=True)


def report_progress(written: int, done: int, max_samples: int | None, started: float) -> None:
    """A line per batch written: samples so far and, when the number to write is known, the ETA at this pace."""
    elapsed = time.monotonic() - started
    left = None if max_samples is None else max(0, max_samples - done - written)
    eta = f", ETA {duration(elapsed / written * left)}" if left and written else ""
    total = f"/{max_samples - done}" if max_samples is not None else ""
    print(f"regenerate: {written}{total} samples after {duration(elapsed)}{eta}", flush=True)


def regenerate_corpus(
    verifier_path: str | Path, corpus: str | Path, output_dir: str | Path, max_seq_len: int,
    max_samples: int | None = None, temperature: float = 0.0, batch_size: int = 32,
    max_new_tokens: int | None = None, devices: Sequence[str] | None = None, seed: int = 0,
    trust_remote_code: bool = False,
) -> Path:
    """Write (or complete) output_dir/regenerated.jsonl from `corpus`; returns its path."""
    started = time.monotonic()
    corpus, output_dir = Path(corpus), Path(output_dir)
    devices = list(devices or default_devices())
    output_dir.mkdir(parents=True, exist_ok=True)
    path, settings_path = output_dir / REGENERATED_FILE, output_dir / SETTINGS_FILE
    settings = {"verifier_path": str(Path(verifier_path).resolve()), "corpus": str(corpus.resolve()),
                "max_seq_len": max_seq_len, "temperature": temperature, "max_new_tokens": max_new_tokens,
                "prompt_fraction": PROMPT_FRACTION, "seed": seed}
    try:
        same = json.loads(settings_path.read_text()) == settings
    except (OSError, ValueError):
        same = False
    if not same:
        path.unlink(missing_ok=True)
        settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    done = read_done(path)

    generate, tokenizer, close = start_generators(verifier_path, devices, temperature, trust_remote_code)

    def run(batch: list[TextSample | ChatSample]) -> list[dict]:
        regenerate_samples(batch, generate, seed + 1009 * batch[0].index)
        return [sample.record(tokenizer) for sample in batch]

    written = 0
    pending: deque[Future] = deque()
    try:
        with open(path, "a", encoding="utf-8") as out, ThreadPoolExecutor(len(devices)) as batches:

            def write_oldest() -> None:
                nonlocal written
                for record in pending.popleft().result():
                    out.write(json.dumps(record) + "\n")
                    written += 1
                out.flush()
                report_progress(written, len(done), max_samples, started)

            batch: list[TextSample | ChatSample] = []
            for sample in iter_regeneration_samples(tokenizer, corpus, max_seq_len, max_new_tokens):
                if max_samples is not None and sample.index >= max_samples:
                    break
                if sample.index in done:
                    continue
                batch.append(sample)
                if len(batch) == batch_size:
                    pending.append(batches.submit(run, batch))
                    batch = []
                while len(pending) > 2 * len(devices) or (pending and pending[0].done()):
                    write_oldest()
            if batch:
                pending.append(batches.submit(run, batch))
            while pending:
                write_oldest()
    finally:
        close()
    print(f"regenerate: {written} samples regenerated ({len(done)} already done) on {', '.join(devices)}, "
          f"{time.monotonic() - started:.0f}s -> {path}", flush=True)
    return path
