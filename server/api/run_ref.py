"""The run a path names: `{run_id}` may be the run's id, a unique prefix of it, or the run's name.

Every route under /v1/runs/{run_id} takes its run through `RunRef`, so the rule lives here and in
server/queries.py (resolve_run_ref) alone. A name is unique among live runs and names its live run; with none
live, its newest ended run, and the answer's `Longrun-Note` header says so and which others the name has."""

from typing import Annotated

from fastapi import Depends, Path, Response

from server import queries
from server.api.deps import DB

# the header that carries what the server chose for the caller (a name that named several ended runs)
NOTE_HEADER = "Longrun-Note"

RUN_ID_PATH = Path(max_length=255, description="the run's id, a unique prefix of it, or its name (its live run, "
                   "else its newest ended one)")


def noted(response: Response, note: str | None) -> None:
    """Say `note` in the answer's Longrun-Note header (ASCII only: a header carries no other text)."""
    if note:
        response.headers[NOTE_HEADER] = note.encode("ascii", "backslashreplace").decode()


def resolve_run(db: DB, response: Response, run_id: Annotated[str, RUN_ID_PATH]) -> str:
    with db.reading() as session:
        found, note = queries.resolve_run_ref(session, run_id)
    noted(response, note)
    return found


RunRef = Annotated[str, Depends(resolve_run)]
