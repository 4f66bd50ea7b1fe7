"""`longrun advise`: the depth to serve and whether a deeper TTT retrain pays off, from an evaluation file
(offline, the advisor itself), or a run's live proposal from the service (`longrun advise RUN_ID`)."""

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from longrun.client import TERMINAL, APIError, Client
from longrun.commands.common import begin, connect, emit
from longrun.exit_codes import ExitCode
from longrun.views import duration
from server.advisor.tables import INTERCONNECTS, NAMED_ALLREDUCE_TABLES

app = typer.Typer()

Interconnect = Enum("Interconnect", {name: name for name in (*INTERCONNECTS, "both")}, type=str)


def proposal_view(p: dict) -> Group:
    """A run's proposal for people: the one-line answer, the verifier priced, the economics, the frontier of
    candidate TTTs, and the advisor's depths with terms."""
    parts: list = [Text(p["summary"])]
    if p.get("verifier"):
        parts.append(Text(f"verifier: {p['verifier']}"))
    for term, basis in (p.get("terms_basis") or {}).items():
        parts.append(Text(f"  {term}: {basis}"))
    if p.get("rule_record"):
        parts.append(Text(f"the retrain rule's record: {p['rule_record']}"))
    parts += evidence_lines(p)
    if probe := p.get("probe"):
        parts.append(Text(f"probe ({probe['status']}): TTT={probe['ttt']} for {probe['steps']} steps from step "
                          f"{probe['from_step']}; {probe['decides']}" + (f"; decided: {probe['decision']}"
                                                                         if probe.get("decision") else "")))
    if p.get("next_step"):
        parts.append(Text(f"next step: {p['next_step']}"))
    if p.get("auto_restart"):
        parts.append(Text(f"on_proposal: {p['auto_restart']}"))
    if p.get("action") == "restart":
        econ = Table(show_header=False, box=None, pad_edge=False)
        for label, value in (
                ("restart body", json.dumps(p["restart"])),
                ("training (dry run)", duration(p.get("predicted_training_seconds"))),
                ("this attempt's ETA", duration(p.get("remaining_seconds"))),
                ("GPU-hours (restart, extra)", f"{_num(p.get('restart_gpu_hours'))}, {_num(p.get('extra_gpu_hours'))}"
                 f" on {p.get('gpus')} GPUs"),
                ("tokens/s now -> after", f"{_num(p.get('tokens_per_second_now'))} at depth {p.get('depth_now')} -> "
                 f"{_num(p.get('tokens_per_second_after'))} at depth {p.get('depth_after')}"),
                ("won back after", f"{_num(p.get('break_even_tokens'))} tokens served"),
                ("predicted tau after", _num(p.get("predicted_tau_after")))):
            econ.add_row(Text(label), Text(value))
        parts.append(econ)
    if p.get("frontier"):
        frontier = Table("TTT", "serve depth", "tokens/s", "gain", "training h", "GPU-h", "extra GPU-h",
                         "break-even tokens", "net GPU-h", title=Text(f"candidates: {p.get('objective') or ''}"))
        for row in p["frontier"]:
            frontier.add_row(*(Text(x) for x in (
                str(row["ttt"]), str(row["depth"]), f"{row['tokens_per_second']:.1f}", f"{row['gain']:+.1%}",
                _num(row.get("training_hours")), _num(row.get("gpu_hours")), _num(row.get("extra_gpu_hours")),
                _num(row.get("break_even_tokens")), _num(row.get("net_gpu_hours")))))
        parts.append(frontier)
    advice = p.get("advice")
    if advice:
        table = Table("depth", "tau", "round ms", "verifier", "verifier AR", "draft", "draft AR", "tokens/s",
                      title=Text(f"{advice['interconnect']}, tp={advice['tp']}: "
                                 f"{(advice.get('drafting') or {}).get('description', '')}"))
        for row in advice["by_depth"]:
            t = row.get("terms") or {}
            table.add_row(*(Text(x) for x in (
                str(row["depth"]), f"{row['mean_accepted']:.3f}", f"{row['round_ms']:.3f}",
                f"{t.get('verifier_ms', 0):.3f}", f"{t.get('verifier_allreduce_ms', 0):.3f} ({t.get('verifier_allreduces', 0)})",
                f"{t.get('draft_compute_ms', 0):.3f}", f"{t.get('draft_allreduce_ms', 0):.3f} ({t.get('draft_allreduces', 0)})",
                f"{row['tokens_per_second']:.1f}")))
        parts.append(table)
    return Group(*parts)


def ended_run_answer(client: Client, run: dict, proposal: dict) -> dict:
    """An ended run has no attempt to restart, so no live proposal: its full answer is the advisor's on its evaluated
    draft, priced on its `deploy` box as the proposal would be (GET /v1/runs/{id}/advice), with the deeper TTTs
    worth a new run. The proposal's answer as it is for a live run, or an ended one never evaluated."""
    if run["status"] not in TERMINAL:
        return proposal
    deploy = (run.get("spec") or {}).get("deploy") or {}
    engine = deploy.get("engine") if deploy.get("engine") in ("sglang", "vllm") else None
    try:
        advice = client.advice(run["id"], tp=deploy.get("tp"), deploy_host=deploy.get("host"), engine=engine,
                               topk=deploy.get("topk") if engine else None)
    except APIError as exc:
        return {**proposal, "summary": f"the run has {run['status']}: no attempt to restart, and no advice on its "
                f"draft: {exc}"}
    retrain = advice.get("retrain") or {}
    ttt = retrain.get("trained_ttt")
    summary = (f"the run has {run['status']} (attempt {advice['attempt']}, TTT={ttt}): no attempt to restart. Its "
               f"draft serves best at depth {advice['recommended_depth']}: {advice['tokens_per_second']:.1f} tokens/s "
               f"({advice['speedup_vs_no_speculation']:.2f}x without speculation) on {advice['interconnect']}, "
               f"tp={advice['tp']}")
    pick = retrain.get("suggested_ttt_steps")
    summary += (f"; a new run at TTT={pick} would serve {retrain.get('tokens_per_second_after') or 0:.1f} tokens/s at "
                f"depth {retrain.get('depth_after')} ({retrain.get('gain') or 0:+.1%}): {retrain.get('reason', '')}"
                if pick else f"; {retrain.get('reason') or 'no deeper TTT pays off'}")
    return {"run_id": run["id"], "attempt": advice["attempt"], "action": "ended", "summary": summary,
            "reason": retrain.get("reason"), "frontier": retrain.get("frontier") or [], "advice": advice,
            "objective": retrain.get("objective"), "allreduce_source": advice.get("allreduce_source")}


def one_verdict(p: dict) -> str:
    """A run's proposal (GET /v1/runs/{id}/proposal, or its `proposal` event) as one line: the verdict, its next
    step where it has one, and the simulation/decoding gap its evidence measured (decoding / simulation per
    position, where an evaluation calibrated it). What `make demo` prints."""
    line = p.get("summary") or p.get("action", "")
    verdict = line.split(": ", 1)[0]
    if p.get("next_step") and p.get("action") in ("probe", "cannot_tell"):
        verdict += f" (next: {p['next_step']})"
    calibration = (p.get("evidence") or {}).get("calibration") or []
    if calibration:
        verdict += (f"; measured decoding / simulation {min(calibration):.2f}-{max(calibration):.2f} by position "
                    f"(the simulation {1 / min(calibration):.1f}x decoding at worst)" if min(calibration) > 0 else "")
    return verdict


def evidence_lines(p: dict) -> list[Text]:
    """Which evidence decided, over how many rounds, each rate with its 90% interval, the rate the retrain rule read
    its decay from, and for cannot_tell what would settle it."""
    e = p.get("evidence")
    if not e:
        return []

    def rates(values: list, bounds: list) -> str:
        return " ".join(f"{a:.3f}" + (f" [{b[0]:.3f}, {b[1]:.3f}]" if b else "")
                        for a, b in zip(values, bounds or [None] * len(values), strict=False))

    lines = [Text(f"decided by: {e['source']}: {e['detail']}"),
             Text(f"  acceptance by position: {rates(e['acceptance'], e.get('acceptance_interval'))}")]
    if e.get("rounds"):
        lines.append(Text(f"  rounds behind them: {' '.join(str(r) for r in e['rounds'])}"))
    if e.get("step_acceptance"):
        lines.append(Text(f"  step acceptance (sim_step_acc_k): "
                          f"{rates(e['step_acceptance'], e.get('step_acceptance_interval'))}"))
    lines.append(Text(f"  interval: {e.get('interval') or 'none'}"))
    lines.append(Text(f"  retrain rule reads: {e.get('decay_from')}: {e.get('decay_note', '')}"))
    if e.get("gain_interval"):
        lines.append(Text(f"  gain over the intervals: {e['gain_interval'][0]:+.1%} to {e['gain_interval'][1]:+.1%}"
                          + (f" (ends: {', '.join(e['verdicts'])})" if e.get("verdicts") else "")))
    if e.get("settle"):
        lines.append(Text(f"  to settle it: {e['settle']}"))
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


@app.command()
def advise(
    ctx: typer.Context,
    run_id: Annotated[str | None, typer.Argument(help="A run: its live proposal from the service (GET "
                                                 "/v1/runs/RUN_ID/proposal).")] = None,
    evaluation: Annotated[Path | None, typer.Option(help="JSON from `python -m trainer.evaluate` or GET "
                                                    "/v1/runs/{id}/evaluation.")] = None,
    interconnect: Annotated[Interconnect, typer.Option(help="The verifier's GPU link; both compares them.")] = "both",
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree of the verifier.")] = 8,
    draft_ms: Annotated[float | None, typer.Option(help="Draft time per proposed token, ms.")] = None,
    verifier_ms: Annotated[float | None, typer.Option(help="Verifier forward per round without communication, "
                                                      "ms.")] = None,
    verifier_per_token_ms: Annotated[float | None, typer.Option(help="Extra verifier time per verified token, "
                                                                "ms.")] = None,
    layers: Annotated[int | None, typer.Option(help="Verifier layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Verifier hidden size.")] = None,
    allreduce_table: Annotated[str | None, typer.Option(
        metavar="FILE|NAME", help="All-reduce times, JSON like tests/fixtures/h200x2/allreduce-*.json, or a named "
        "table: " + ", ".join(NAMED_ALLREDUCE_TABLES) + ".")] = None,
    trained_ttt: Annotated[int | None, typer.Option(help="TTT steps the draft was trained with.")] = None,
    retrain_seconds: Annotated[list[str] | None, typer.Option(
        metavar="TTT=SECONDS", help="Predicted training time for a TTT depth (repeatable), e.g. 5=5400.")] = None,
    min_gain: Annotated[float, typer.Option(help="Least speed-up worth a retrain.")] = 0.02,
    engine: Annotated[str | None, typer.Option(help="The serving engine: sglang (draft sharded at --tp), vllm "
                                               "(by --engine-version: V1, the default, shards it at --tp; V0 "
                                               "with --draft-tp 1 replicates it), or unset (the draft's "
                                               "collectives not priced). With one --interconnect.")] = None,
    engine_version: Annotated[str | None, typer.Option(help="With --engine vllm: its version (0.11.0, v0, "
                                                       "v1).")] = None,
    verifier: Annotated[Path | None, typer.Option(help="The verifier's config.json or model directory: its "
                                                  "layers, experts, attention and weight bits price each "
                                                  "forward (default: a 70B-class dense bf16 model).")] = None,
    ep: Annotated[int, typer.Option(help="With --verifier, an MoE one: expert parallelism, 1 or --tp.")] = 1,
    topk: Annotated[int, typer.Option(help="With --engine: 1 chain drafting, more a tree of top-k per step.")] = 1,
    draft_tp: Annotated[int | None, typer.Option(help="With --engine vllm: its draft_tensor_parallel_size.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON output (the answer from a file is always JSON).")] = False,
    probe: Annotated[bool, typer.Option("--probe", help="With RUN_ID: take the probe its proposal offers (resume "
                                        "at the candidate TTT for N steps, then decide on measured acceptance).")] = False,
) -> int:
    """Expected tokens/s per speculation depth, the depth to serve, and whether a deeper TTT retrain pays off.

    With RUN_ID: the service's live proposal for the run (restart at TTT=N or keep going, with the dry run,
    GPU-hours and tokens/s on its deploy host). With --evaluation: the advisor on that file; the trained TTT
    depth is the file's `ttt_steps` unless --trained-ttt says otherwise. Defaults: a 70B-class verifier
    (80 layers, hidden 8192) on H200s; PCIe is the NVLink all-reduce table plus 3 µs per ring step per call
    (2*(tp-1) steps). Bad input exits 2 with the reason."""
    if (run_id is None) == (evaluation is None):
        raise typer.BadParameter("give a RUN_ID (its live proposal) or --evaluation FILE, one of the two")
    if run_id is not None:
        begin(as_json)
        with connect(ctx) as client:
            answer = client.proposal(run_id)
            if probe:
                client.take_probe(run_id)
                answer = client.proposal(run_id)
            if answer.get("action") == "unavailable":
                answer = ended_run_answer(client, client.get(run_id), answer)
        emit(answer, as_json, proposal_view(answer))
        return ExitCode.OK
    from server.advisor import CostModel, Drafting, compare_interconnects, load_allreduce_table
    from server.advisor import advise as advise_depth

    overrides: dict[str, object] = {
        field: value
        for field, value in (("draft_step_ms", draft_ms), ("verifier_base_ms", verifier_ms),
                             ("verifier_per_token_ms", verifier_per_token_ms), ("layers", layers), ("hidden", hidden))
        if value is not None
    }
    link = interconnect.value if isinstance(interconnect, Interconnect) else interconnect
    try:
        with open(evaluation) as f:
            try:
                report = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{evaluation} is not JSON: {exc}") from None
        if trained_ttt is None and isinstance(report, dict):
            # the API's evaluation (and trainer.evaluate's) says which TTT depth the draft was trained with
            stated = report.get("ttt_steps")
            if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 1:
                trained_ttt = stated
        if allreduce_table:
            if link == "both":
                raise ValueError("--allreduce-table is one interconnect's table: pick --interconnect pcie or nvlink")
            overrides["allreduce_us"] = load_allreduce_table(allreduce_table)
        seconds = {}
        for item in retrain_seconds or []:
            ttt, _, value = item.partition("=")
            try:
                seconds[int(ttt)] = float(value)
            except ValueError:
                raise ValueError(f"--retrain-seconds wants TTT=SECONDS, e.g. 5=5400; got {item!r}") from None
        if (engine is not None or verifier is not None) and link == "both":
            raise ValueError("--engine and --verifier price one deployment: pick --interconnect pcie or nvlink")
        if link == "both":
            result = compare_interconnects(report, tp, trained_ttt, seconds or None, min_gain, **overrides)
        else:
            if verifier is not None:
                from server.advisor.tables import default_allreduce_us
                from server.advisor.verifier import Parallelism, VerifierShape, name_of, read_config

                config = read_config(str(verifier))
                shape = VerifierShape.from_config(config, name_of(str(verifier), config))
                cost = CostModel.for_verifier(shape, Parallelism(tp, ep if shape.experts else 1),
                                              overrides.get("allreduce_us") or default_allreduce_us(link, tp))
            else:
                cost = CostModel.for_interconnect(link, tp, **overrides)
            drafting = Drafting(engine=engine, topk=topk, draft_tp=draft_tp,
                                engine_version=engine_version) if engine is not None else None
            result = advise_depth(report, link, tp, cost, trained_ttt, seconds or None, min_gain, drafting=drafting)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    json.dump(result.model_dump(mode="json"), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return ExitCode.OK
