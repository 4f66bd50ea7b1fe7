"""The depth experiment (issue 5): drafts trained with TTT 1, 3, 5, 7 on identical data and steps, and
their acceptance at every position out to --max-depth, with what each depth buys on PCIe vs NVLink.

    python benchmarks/depth_experiment.py --out OUT [--size small] [--steps 2000] [--max-depth 16]

Writes OUT/results.json, OUT/table.md and, when matplotlib is installed, OUT/acceptance.png.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.advisor import compare_interconnects  # noqa: E402


def run(argv: list[str], log: Path, env: dict | None = None) -> float:
    t = time.time()
    with open(log, "w") as f:
        subprocess.run(argv, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return time.time() - t


def train_and_evaluate(args: argparse.Namespace, verifier: Path, data: Path, ttt: int, device: str | None) -> dict:
    out = args.work / f"draft-ttt{ttt}"
    env = {**os.environ, "LONGRUN_METRICS_FILE": str(out / "metrics.jsonl")}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    out.mkdir(parents=True, exist_ok=True)
    train_s = run([sys.executable, "-m", "trainer.train", "--verifier-path", str(verifier),
                   "--data-dir", str(data / "hidden_states"), "--vocab-mapping-dir", str(data / "vocab_mapping"),
                   "--output-dir", str(out), "--epochs", "1000", "--max-steps", str(args.steps), "--lr", str(args.lr),
                   "--max-seq-len", str(args.seq), "--num-workers", "2", "--ttt-steps", str(ttt),
                   "--noise-std", "0.05", "--scheduler", "cosine", "--warmup-ratio", "0.01", "--val-ratio", "0.05",
                   "--seed", "0"], args.out / f"train-ttt{ttt}.log", env)
    report_path = args.out / f"evaluation-ttt{ttt}.json"
    eval_s = run([sys.executable, "-m", "trainer.evaluate", "--verifier-path", str(verifier), "--draft-path", str(out),
                  "--corpus", str(verifier / "corpus" / "heldout.txt"), "--max-depth", str(args.max_depth),
                  "--max-samples", str(args.samples), "--max-new-tokens", str(args.new_tokens),
                  "--measure-depths", args.measure_depths, "--output", str(report_path)], args.out / f"evaluate-ttt{ttt}.log", env)
    report = json.loads(report_path.read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = [x for x in lines if "loss" in x][-1]
    return {"ttt": ttt, "train_seconds": train_s, "eval_seconds": eval_s, "final_train": last, "evaluation": report}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/longrun-depth"))
    p.add_argument("--size", default="tiny")
    p.add_argument("--ttt", default="1,3,5,7")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--samples", type=int, default=16, help="held-out prompts")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--max-depth", type=int, default=16)
    p.add_argument("--measure-depths", default="",
                   help="depths decoded for real besides max-depth (default none: τ at every depth comes from "
                        "the max-depth decoding; a real decode per depth costs as much again per depth)")
    p.add_argument("--max-samples", type=int, default=2000, help="training samples prepared")
    p.add_argument("--parallel", type=int, default=1, help="drafts trained at once (one GPU each)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    verifier, data = args.work / f"verifier-{args.size}", args.work / f"data-{args.size}-{args.seq}"
    timings = {"verifier_s": run([sys.executable, "-m", "trainer.verifier", "--output-dir", str(verifier),
                                  "--size", args.size], args.out / "verifier.log")}
    if not (data / "prepare.json").exists():
        timings["prepare_s"] = run([sys.executable, "-m", "trainer.prepare", "--verifier-path", str(verifier),
                                    "--corpus", str(verifier / "corpus" / "train.jsonl"), "--output-dir", str(data),
                                    "--max-seq-len", str(args.seq), "--max-samples", str(args.max_samples)],
                                   args.out / "prepare.log")
    depths = [int(x) for x in args.ttt.split(",")]
    results = []
    if args.parallel > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.parallel) as pool:
            futures = [pool.submit(train_and_evaluate, args, verifier, data, t, str(i % args.parallel))
                       for i, t in enumerate(depths)]
            results = [f.result() for f in futures]
    else:
        results = [train_and_evaluate(args, verifier, data, t, None) for t in depths]

    for r in results:
        r["advice"] = compare_interconnects(r["evaluation"], tp=8, trained_ttt=r["ttt"]).model_dump()
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "timings": timings, "drafts": results}, indent=1))
    table = ["| trained TTT | " + " | ".join(str(d) for d in range(1, args.max_depth + 1)) + " |",
             "|---" * (args.max_depth + 1) + "|"]
    for r in results:
        cond = r["evaluation"]["conditional_acceptance"]
        table.append(f"| {r['ttt']} (acceptance at position) | " + " | ".join(f"{a:.2f}" for a in cond) + " |")
    for r in results:
        taus = [row["mean_accepted"] for row in r["evaluation"]["by_depth"]]
        table.append(f"| {r['ttt']} (τ at depth) | " + " | ".join(f"{t:.2f}" for t in taus) + " |")
    table += ["", "| trained TTT | final loss_0 | NVLink: depth, tokens/s | PCIe: depth, tokens/s |", "|---|---|---|---|"]
    for r in results:
        a = r["advice"]
        table.append(f"| {r['ttt']} | {r['final_train'].get('loss_0', float('nan')):.3f} | "
                     f"{a['nvlink']['recommended_depth']}, {a['nvlink']['tokens_per_second']:.0f} | "
                     f"{a['pcie']['recommended_depth']}, {a['pcie']['tokens_per_second']:.0f} |")
    (args.out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return 0
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        cond = r["evaluation"]["conditional_acceptance"]
        positions = range(1, len(cond) + 1)
        left.plot(positions, cond, marker="o", label=f"TTT={r['ttt']}")
        left.axvline(r["ttt"], color=left.lines[-1].get_color(), linestyle=":", alpha=0.5)
        right.plot(positions, [row["mean_accepted"] for row in r["evaluation"]["by_depth"]], marker="o",
                   label=f"TTT={r['ttt']}")
    left.set(xlabel="draft position", ylabel="acceptance given earlier accepted",
             title="Acceptance by position (dotted: trained depth)")
    right.set(xlabel="speculation depth", ylabel="mean tokens per verifier pass (τ)", title="τ by depth")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(args.out / "acceptance.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
