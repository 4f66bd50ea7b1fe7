"""Does the data loader keep the GPU busy? The real trainer, training from files on disk, watched by nvidia-smi.

    python benchmarks/bench_from_disk.py --work /tmp/disk --out result.json [--seq 2048 --ttt 3 --nproc 1]
        [--shape llama-8b|kimi-k2|tiny] [--store-dtype bf16|fp8]

Writes a verifier directory of --shape (config + embedding, final norm and lm_head, random: Llama-3.1-8B, or
kimi-k2: 7168 hidden, 163840 vocab, the draft SpecForge trains for that family, 56 heads x 128, 8 KV heads), a
vocab mapping, and --samples per-sample files in `trainer.prepare`'s layout (random features: ~67 MB each at 2048
tokens for llama-8b in bf16, ~117 MB for kimi-k2, half that with `--store-dtype fp8`: float8_e4m3fn with a scale
per token, as `prepare --store-dtype fp8` writes), drops the page cache when it may (root), then runs the production command
(`torchrun -m trainer.train ... --num-workers 4`) for --steps steps while sampling each GPU's
utilisation every 0.2 s. Reports, over the steps after the first --skip: utilisation per GPU
(mean, and the share of samples at or above 95%), tokens/s and ms/step from the trainer's own metrics, and its
measure of the wait for data (`data_wait_ms` mean per step: a few long waits, most none, `input_bound` the share of the steps' time spent
waiting); with --size-readers the command leaves --num-workers out and `readers` is the loader's line on what it
chose.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_trainer import KIMI_K2, LLAMA_8B, TINY, random_vocab_mapping  # noqa: E402
from trainer.data import FP8_SCALES, quantize_fp8  # noqa: E402
from trainer.vocab import save_vocab_mapping  # noqa: E402

SHAPES = {"llama-8b": LLAMA_8B, "kimi-k2": KIMI_K2, "tiny": TINY}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the random tensors are drawn


def write_verifier(path: Path, shape: dict = LLAMA_8B) -> None:
    """A verifier directory of this shape: config, and random embedding, final norm and lm_head."""
    from transformers import LlamaConfig

    H, V = shape["hidden_size"], shape["vocab_size"]
    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(hidden_size=H, intermediate_size=shape["intermediate_size"], num_attention_heads=shape["num_attention_heads"],
                num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                num_hidden_layers=shape.get("num_hidden_layers", 32), vocab_size=V,
                max_position_embeddings=131072, rope_theta=shape["rope_theta"],
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    with torch.device(DEVICE):
        tensors = {"model.embed_tokens.weight": torch.randn(V, H, dtype=torch.bfloat16) * 0.02,
                   "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
                   "lm_head.weight": torch.randn(V, H, dtype=torch.bfloat16) * 0.02}
    save_file({k: v.cpu() for k, v in tensors.items()}, str(path / "model.safetensors"))


def write_data(path: Path, samples: int, seq: int, shape: dict = LLAMA_8B, store_dtype: str = "bf16") -> None:
    """`samples` per-sample files of random features in `prepare`'s layout, and a random vocab mapping."""
    H, V, DRAFT_V = shape["hidden_size"], shape["vocab_size"], shape["draft_vocab_size"]
    layers = shape.get("num_hidden_layers", 32)
    (path / "hidden_states").mkdir(parents=True, exist_ok=True)
    for stale in (path / "hidden_states").glob("sample_*.safetensors"):
        stale.unlink()
    ids, t2d = random_vocab_mapping(V, DRAFT_V)
    save_vocab_mapping(path / "vocab_mapping", ids - torch.arange(DRAFT_V), t2d)
    (path / "prepare.json").write_text(json.dumps({"layer_ids": [2, layers // 2, layers - 3], "hidden_size": H,
                                                   "vocab_size": V, "store_dtype": store_dtype}))
    for i in range(samples):
        with torch.device(DEVICE):
            sample = {"input_ids": torch.randint(0, V, (seq,)), "loss_mask": torch.ones(seq, dtype=torch.uint8),
                      "hidden_states": torch.randn(seq, 3 * H, dtype=torch.bfloat16),
                      "last_hidden_state": torch.randn(seq, H, dtype=torch.bfloat16),
                      # as `prepare` stores it: the verifier's top-1 (uniform over the vocabulary, as a random head's
                      # argmax is in bench_trainer.py); without it the trainer runs the full verifier head every step
                      "verifier_top_ids": torch.randint(0, V, (seq,), dtype=torch.int32)}
            if store_dtype == "fp8":
                for name, scale in FP8_SCALES.items():
                    sample[name], sample[scale] = quantize_fp8(sample[name])
        save_file({k: v.cpu() for k, v in sample.items()}, str(path / "hidden_states" / f"sample_{i:06d}.safetensors"))


def read_rate(files: list[Path], readers: int = 4) -> float:
    """GB/s of reading these files whole with `readers` threads (the loader's worker count)."""
    from concurrent.futures import ThreadPoolExecutor

    def read(path: Path) -> int:
        with open(path, "rb", buffering=0) as f:
            return sum(iter(lambda: len(f.read(1 << 24)), 0))

    t = time.time()
    with ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(read, files))
    return total / (time.time() - t) / 1e9


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


class Utilisation(threading.Thread):
    def __init__(self, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            now = time.time()
            for line in out.strip().splitlines():
                fields = [x.strip() for x in line.split(",")]
                if len(fields) == 2 and fields[0].isdigit():
                    self.samples.append((now, int(fields[0]), float(fields[1])))
            time.sleep(self.every)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the JSON result")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--steps", type=int, default=220,
                   help="keep it under one epoch: the epoch end validates and checkpoints")
    p.add_argument("--skip", type=int, default=25,
                   help="first steps left out of the figures (warm-up: torch.compile is still compiling at step 10)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--size-readers", action="store_true",
                   help="leave --num-workers out: the loader sizes its readers from the read rate it measures")
    p.add_argument("--warm", action="store_true", help="keep the page cache (files read from memory)")
    p.add_argument("--profile", type=Path, help="also profile steps 41-50 into this dir (trainer/profiling.py); "
                   "the figures then carry the profiler's overhead")
    p.add_argument("--trainer", default="trainer.train",
                   help="the module (or a .py script) torchrun runs, e.g. benchmarks/loader_variants.py")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="the verifier's and draft's shape")
    p.add_argument("--tiny", action="store_true", help="--shape tiny (CPU smoke test)")
    p.add_argument("--store-dtype", choices=("bf16", "fp8"), default="bf16", help="how the features are stored")
    p.add_argument("--no-sampler", action="store_true", help="do not run nvidia-smi during training")
    args = p.parse_args()
    if args.steps >= int(args.samples * 0.95):  # --val-ratio 0.05: an epoch end would validate and checkpoint
        p.error(f"--steps {args.steps} reaches the end of an epoch of {args.samples} samples: keep it under one")
    shape_name = "tiny" if args.tiny else args.shape
    shape = SHAPES[shape_name]
    verifier, output = args.work / f"verifier-{shape_name}", args.work / "out"
    data = args.work / f"data-{shape_name}-{args.store_dtype}-{args.seq}"
    t0 = time.time()
    if not (verifier / "model.safetensors").exists():
        write_verifier(verifier, shape)
    if len(list((data / "hidden_states").glob("sample_*.safetensors"))) != args.samples:
        write_data(data, args.samples, args.seq, shape, args.store_dtype)
    written_s = time.time() - t0
    subprocess.run(["rm", "-rf", str(output)], check=True)
    cache_dropped, disk_gb_s = False, None
    if not args.warm and drop_page_cache():
        disk_gb_s = read_rate(sorted((data / "hidden_states").glob("sample_*.safetensors"))[-24:], args.num_workers)
        cache_dropped = drop_page_cache()
    sampler = Utilisation()
    if not args.no_sampler:
        sampler.start()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               *([args.trainer] if args.trainer.endswith(".py") else ["-m", args.trainer]),
               "--verifier-path", str(verifier), "--data-dir", str(data / "hidden_states"),
               "--vocab-mapping-dir", str(data / "vocab_mapping"), "--output-dir", str(output), "--epochs", "5",
               "--lr", "3e-5", "--max-seq-len", str(args.seq),
               *([] if args.size_readers else ["--num-workers", str(args.num_workers)]),
               "--ttt-steps", str(args.ttt), "--noise-std", "0.05", "--scheduler", "cosine", "--warmup-ratio", "0.01",
               "--val-ratio", "0.05", "--max-steps", str(args.steps)]
    started = time.time()
    env = dict(os.environ)
    if args.profile:
        env.update(LONGRUN_PROFILE_DIR=str(args.profile), LONGRUN_PROFILE_STEPS="37:10")
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    sampler.stop.set()
    if sampler.is_alive():
        sampler.join()
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    steps = [r for r in map(json.loads, (output / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    window = steps[args.skip:]
    begin, end = window[0]["time"], window[-1]["time"]
    result = {
        "command": " ".join(command), "shape": shape_name, "hidden_size": shape["hidden_size"],
        "vocab_size": shape["vocab_size"], "store_dtype": args.store_dtype, "seq": args.seq, "ttt": args.ttt,
        "nproc": args.nproc,
        "samples_on_disk": args.samples, "sample_mb": round((data / "hidden_states" / "sample_000000.safetensors").stat().st_size / 1e6, 1),
        "page_cache_dropped": cache_dropped, "cold_read_gb_s": disk_gb_s and round(disk_gb_s, 2), "write_s": round(written_s, 1), "startup_s": round(steps[0]["time"] - started, 1),
        "steps_measured": len(window), "ms_per_step": round((end - begin) / max(1, len(window) - 1) * 1000, 2),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in window)),
        # the trainer's own measure of the wait for data (trainer/series.py): median per step, and its share
        "data_wait_ms": round(statistics.mean(r.get("data_wait_s", 0.0) for r in window) * 1000, 2),
        "input_bound": round(sum(r.get("data_wait_s", 0.0) for r in window)
                             / max(sum(r.get("step_time_s", 0.0) for r in window), 1e-9), 3),
        "readers": [line for line in proc.stdout.splitlines() if line.startswith("readers: ")],
        "disk_bytes_per_token": round((data / "hidden_states" / "sample_000000.safetensors").stat().st_size / args.seq),
        "gpus": {},
    }
    for gpu in sorted({i for _, i, _ in sampler.samples}):
        utils = [u for t, i, u in sampler.samples if i == gpu and begin <= t <= end]
        if utils:
            result["gpus"][gpu] = {"samples": len(utils), "mean_util": round(statistics.mean(utils), 1),
                                   "share_at_least_95": round(sum(u >= 95 for u in utils) / len(utils), 3),
                                   "min_util": min(utils)}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
