"""`longrun advise`: the depth to serve and whether a deeper TTT retrain pays off, from an evaluation file."""

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from longrun.exit_codes import ExitCode
from server.advisor.tables import INTERCONNECTS, NAMED_ALLREDUCE_TABLES

app = typer.Typer()

Interconnect = Enum("Interconnect", {name: name for name in (*INTERCONNECTS, "both")}, type=str)


@app.command()
def advise(
    evaluation: Annotated[Path, typer.Option(help="JSON from `python -m trainer.evaluate`.")],
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
    as_json: Annotated[bool, typer.Option("--json", help="JSON output (the answer is always JSON; accepted for "
                                                         "symmetry with the other commands).")] = True,
) -> int:
    """Expected tokens/s per speculation depth, the depth to serve, and whether a deeper TTT retrain pays off.

    Defaults: a 70B-class verifier (80 layers, hidden 8192) on H200s; PCIe is the NVLink all-reduce table plus
    3 µs per ring step per call (2*(tp-1) steps). Bad input exits 2 with the reason."""
    from server.advisor import CostModel, compare_interconnects, load_allreduce_table
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
        if link == "both":
            result = compare_interconnects(report, tp, trained_ttt, seconds or None, min_gain, **overrides)
        else:
            cost = CostModel.for_interconnect(link, tp, **overrides)
            result = advise_depth(report, link, tp, cost, trained_ttt, seconds or None, min_gain)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    json.dump(result.model_dump(mode="json"), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return ExitCode.OK
