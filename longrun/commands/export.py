"""`longrun export RUN --tensorboard DIR`: a run's stored metrics as files another tool reads."""

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from longrun.commands.common import JsonFlag, begin, connect, emit, stderr
from longrun.exit_codes import ExitCode

app = typer.Typer()

# the API answers at most this many points per call (server/api/routes/runs.py)
MAX_POINTS = 1_000_000


@app.command()
def export(
    ctx: typer.Context,
    run_id: Annotated[str, typer.Argument(help="The run's id.")],
    tensorboard: Annotated[Path, typer.Option(help="Write TensorBoard event files under DIR/<run id>/ (an earlier "
                                              "export there is replaced); view with `tensorboard --logdir DIR`.",
                                              metavar="DIR", file_okay=False)],
    as_json: JsonFlag = False,
) -> int:
    """A run's stored metrics, all attempts, as TensorBoard event files."""
    begin(as_json)
    try:
        from longrun.tensorboard_export import write_tensorboard
    except ImportError:
        raise typer.BadParameter("needs the tensorboard package: pip install 'longrun[tracking]'") from None
    with connect(ctx) as client:
        run = client.get(run_id)
        series = {}
        for attempt in run["attempts"]:
            answer = client.metrics(run_id, attempt=attempt["number"], limit=MAX_POINTS)
            if sum(len(v) for v in answer.values()) >= MAX_POINTS:
                stderr().print(f"warning: attempt {attempt['number']} has more than {MAX_POINTS} points; "
                               "the export holds the first of them")
            for name, points in answer.items():
                series.setdefault(name, []).extend(points)
    summary = write_tensorboard(run, series, tensorboard)
    emit(asdict(summary), as_json, f"wrote {summary.points} points of {summary.series} metrics from attempts "
         f"{', '.join(map(str, summary.attempts)) or 'none'} to {summary.directory}")
    return ExitCode.OK
