"""The simulated acceptance of a run's last validation beside the acceptance its end-of-training evaluation measured.

    python benchmarks/sim_vs_evaluate.py O/metrics.jsonl [--json]

Reads a trainer's metrics file (a run with `--eval-corpus`, so that its last line carries `evaluation`): per depth
d, `sim_tau_d` from the last validation line, `evaluate`'s τ by real greedy decoding (`mean_accepted`, counted on
its max-depth rounds) and on the held-out text as written (`dataset_text`), and the gaps; per position k,
`sim_acc_k` beside decoding's conditional acceptance. docs/benchmarks.md ("Simulated acceptance") has the demo's.
"""

import argparse
import json
import sys
from pathlib import Path


def compare(lines: list[dict]) -> dict:
    validation = next((x for x in reversed(lines) if "sim_tau_1" in x), None)
    evaluation = next((x["evaluation"] for x in reversed(lines) if isinstance(x.get("evaluation"), dict)), None)
    if validation is None or evaluation is None:
        raise SystemExit("need a validation line with sim_tau_* and an evaluation line (train with --eval-corpus)")
    depth = min(sum(1 for k in validation if k.startswith("sim_tau_")), len(evaluation["by_depth"]))
    dataset = (evaluation.get("dataset_text") or {}).get("by_depth") or []
    rows = []
    for d in range(1, depth + 1):
        row = evaluation["by_depth"][d - 1]
        sim, real, interval = validation[f"sim_tau_{d}"], row["mean_accepted"], row.get("mean_accepted_interval")
        text = dataset[d - 1]["mean_accepted"] if d <= len(dataset) else None
        rows.append({"depth": d, "sim_tau": round(sim, 3), "decode_tau": round(real, 3),
                     "decode_tau_interval": interval, "gap": round(sim - real, 3),
                     "relative_gap": round((sim - real) / real, 4),
                     "inside_interval": interval is not None and interval[0] <= sim <= interval[1],
                     "dataset_text_tau": round(text, 3) if text is not None else None,
                     "sim_acc": round(validation[f"sim_acc_{d}"], 3),
                     "decode_conditional_acceptance": round(evaluation["conditional_acceptance"][d - 1], 3)})
    return {"step": validation["step"], "ttt_steps": evaluation.get("draft_ttt_steps"), "rounds": evaluation["rounds"],
            "by_depth": rows, "largest_relative_gap": max(abs(r["relative_gap"]) for r in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = compare([json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()])
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"TTT={result['ttt_steps']}, last validation at step {result['step']}, decoding: {result['rounds']} rounds")
    print("depth  sim_tau  decode_tau [90% interval]  gap      dataset_text_tau  sim_acc  decode_cond_acc")
    for r in result["by_depth"]:
        text = f"{r['dataset_text_tau']:.2f}" if r["dataset_text_tau"] is not None else "-"
        low, high = r["decode_tau_interval"] or (float("nan"), float("nan"))
        print(f"{r['depth']:>5}  {r['sim_tau']:7.2f}  {r['decode_tau']:10.2f} [{low:5.2f}-{high:5.2f}]{'*' if r['inside_interval'] else ' '}"
              f"  {r['relative_gap']:+7.1%}  {text:>16}  "
              f"{r['sim_acc']:7.2f}  {r['decode_conditional_acceptance']:15.2f}")
    print(f"largest gap: {result['largest_relative_gap']:.1%}; * sim_tau inside decoding's 90% interval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
