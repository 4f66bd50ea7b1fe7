"""`trainer.prepare` with a verifier sharded over several safetensors files and spread over several GPUs,
killed mid-way and resumed.

    python benchmarks/prepare_multi_gpu.py --work DIR              # GPUs: every visible one (device_map auto)
    python benchmarks/prepare_multi_gpu.py --work DIR --tiny       # CPU, a tiny verifier, in a minute

Builds a demo verifier (trainer/demo_verifier.py; a few training steps: its quality does not matter here),
re-saves it in shards with an index (as large releases ship), runs `python -m trainer.prepare` on its
corpus, SIGKILLs it once a quarter of the samples are on disk, relaunches the same command, and prints a
JSON summary: the device of every decoder layer, the samples written, those on disk at the kill, those the
relaunch skipped (they must be equal), and the seconds of each part. Exits non-zero when the relaunch did
not skip exactly the samples written before the kill or recomputed a different number of samples.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.demo_verifier import PRESETS, VerifierPreset, build_verifier, stdlib_root  # noqa: E402

TINY = VerifierPreset(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=8, num_heads=4,
                      num_kv_heads=2, seq_len=64, batch_size=4, steps=2, lr=3e-3, sources="top-level")
TINY_SOURCES = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py", "copy.py")


def sharded_verifier(work: Path, tiny: bool) -> tuple[Path, Path, int]:
    """(verifier dir in several safetensors shards + index, its corpus, the number of shard files)."""
    built = work / "verifier"
    if tiny:
        build_verifier(built, TINY, source_files=[stdlib_root() / name for name in TINY_SOURCES], device="cpu")
    else:
        build_verifier(built, replace(PRESETS["base"], sources="top-level", steps=20))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sharded = work / "verifier_sharded"
    shutil.rmtree(sharded, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32 if tiny else torch.bfloat16)
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) // 6
    model.save_pretrained(sharded, max_shard_size=max(shard_bytes, 1 << 16))
    AutoTokenizer.from_pretrained(built).save_pretrained(sharded)
    shards = len(list(sharded.glob("*.safetensors")))
    if shards < 2 or not (sharded / "model.safetensors.index.json").is_file():
        raise SystemExit(f"expected a sharded checkpoint in {sharded}, found {shards} file(s)")
    return sharded, built / "corpus" / "train.jsonl", shards


def sample_count(out: Path) -> int:
    return len(list((out / "hidden_states").glob("sample_*.safetensors")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU and a tiny verifier (a check that runs anywhere)")
    parser.add_argument("--max-samples", type=int, help="default: 400 (--tiny) or 4000")
    parser.add_argument("--max-seq-len", type=int, help="default: 32 (--tiny) or 1024")
    parser.add_argument("--batch-size", type=int, help="default: 1 (--tiny) or 16")
    args = parser.parse_args(argv)
    max_samples = args.max_samples or (400 if args.tiny else 4000)
    args.work.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    verifier, corpus, shards = sharded_verifier(args.work, args.tiny)
    build_seconds = time.monotonic() - started
    out = args.work / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable, "-m", "trainer.prepare", "--verifier-path", str(verifier), "--corpus", str(corpus),
        "--output-dir", str(out), "--max-samples", str(max_samples),
        "--max-seq-len", str(args.max_seq_len or (32 if args.tiny else 1024)),
        "--batch-size", str(args.batch_size or (1 if args.tiny else 16)),
        "--draft-vocab-size", "256" if args.tiny else "8192", "--device", "cpu" if args.tiny else "auto",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if args.tiny:
        env["OMP_NUM_THREADS"] = "1"

    started = time.monotonic()
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while sample_count(out) < max_samples // 4:
        if first.poll() is not None:
            raise SystemExit(f"prepare ended before the kill (exit {first.returncode}):\n{first.stderr.read()[-3000:]}")
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    first_seconds = time.monotonic() - started
    at_kill = sample_count(out)

    started = time.monotonic()
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    resume_seconds = time.monotonic() - started
    if second.returncode != 0:
        raise SystemExit(f"the resumed prepare failed:\n{second.stderr[-3000:]}")
    metadata = json.loads((out / "prepare.json").read_text())
    devices = metadata["layer_devices"]
    summary = {
        "verifier_shards": shards,
        "devices": sorted(set(devices)),
        "device_of_layer": dict(enumerate(devices)),
        "samples_written": metadata["num_samples"],
        "samples_on_disk_at_kill": at_kill,
        "samples_skipped_on_resume": metadata["resumed_samples"],
        "samples_computed_on_resume": metadata["num_samples"] - metadata["resumed_samples"],
        "tokens": metadata["num_tokens"],
        "seconds_build_verifier": round(build_seconds, 1),
        "seconds_until_kill": round(first_seconds, 1),
        "seconds_resumed_run": round(resume_seconds, 1),
    }
    print(json.dumps(summary, indent=2))
    ok = summary["samples_skipped_on_resume"] == at_kill and metadata["num_samples"] == max_samples == sample_count(out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
