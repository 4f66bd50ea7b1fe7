"""FP8 against bf16 storage on the demo: bytes per token on disk, then loss and acceptance of the same training.

    python benchmarks/bench_fp8_storage.py [--work .demo/fp8] [--epochs 3]

Builds (or reuses) `make demo`'s verifier (.demo/verifier), prepares its training corpus as written twice
(`prepare --store-dtype bf16` and `fp8`, examples/demo.py's settings: 400 samples of 128 tokens, draft vocab 1024),
trains a TTT=3 draft on each with the demo's flags (one process, the same seed), and prints one JSON line: feature
bytes per token, the last validation loss and acc_0, and τ at each depth of real speculative decoding on the
held-out text with its 90 % interval (trainer.evaluate, resampling the prompts).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(ROOT))

from trainer.data import list_samples  # noqa: E402


def bytes_per_token(data: Path) -> dict[str, float]:
    from safetensors import safe_open

    sizes = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "I64": 8, "I32": 4, "U8": 1}
    features = total = tokens = 0
    for path in list_samples(data / "hidden_states"):
        total += path.stat().st_size
        with safe_open(path, "pt") as file:
            tokens += file.get_slice("input_ids").get_shape()[0]
            for name in file.keys():
                piece = file.get_slice(name)
                if name.startswith(("hidden_states", "last_hidden_state")):
                    count = 1
                    for n in piece.get_shape():
                        count *= n
                    features += count * sizes[piece.get_dtype()]
    return {"feature_bytes_per_token": features / tokens, "file_bytes_per_token": round(total / tokens, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / ".demo" / "fp8")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-samples", type=int, default=32)
    args = parser.parse_args()
    verifier = ROOT / ".demo" / "verifier"
    subprocess.run([sys.executable, "-m", "trainer.demo_verifier", "--output-dir", str(verifier), "--size", "tiny"],
                   cwd=ROOT, check=True)
    results = {}
    for store in ("bf16", "fp8"):
        data, out = args.work / f"data-{store}", args.work / f"out-{store}"
        if not (data / "prepare.json").exists():
            subprocess.run([sys.executable, "-m", "trainer.prepare", "--verifier-path", str(verifier), "--corpus",
                            str(verifier / "corpus" / "train.jsonl"), "--output-dir", str(data), "--max-seq-len",
                            "128", "--max-samples", "400", "--draft-vocab-size", "1024", "--device", "cpu",
                            "--store-dtype", store], cwd=ROOT, check=True)
        subprocess.run([sys.executable, "-m", "trainer.train", "--verifier-path", str(verifier), "--data-dir",
                        str(data / "hidden_states"), "--vocab-mapping-dir", str(data / "vocab_mapping"),
                        "--output-dir", str(out), "--no-resume", "--epochs", str(args.epochs), "--lr", "3e-3",
                        "--max-seq-len", "128", "--num-workers", "1", "--ttt-steps", "3", "--noise-std", "0.05",
                        "--scheduler", "cosine", "--warmup-ratio", "0.01", "--val-ratio", "0.05",
                        "--eval-corpus", str(verifier / "corpus" / "heldout.txt"), "--eval-max-depth", "6",
                        "--eval-samples", str(args.eval_samples), "--eval-new-tokens", "96", "--seed", "0"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        validation = [x for x in lines if "val_loss" in x][-1]
        report = [x for x in lines if "evaluation" in x][-1]["evaluation"]
        results[store] = {
            **bytes_per_token(data),
            "val_loss": round(validation["val_loss"], 4),
            "val_acc_0": round(validation.get("val_acc_0", float("nan")), 4),
            "tau": {row["depth"]: [round(row["mean_accepted"], 3), [round(b, 3) for b in row.get("mean_accepted_interval") or []]]
                    for row in report["by_depth"]},
        }
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
