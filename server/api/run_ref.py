"""The run a path names: `{run_id}` may be the run's id, a unique prefix of it, or the run's unique name.

Every route under /v1/runs/{run_id} takes its run through `RunRef`, so the rule lives here and in
server/queries.py (resolve_run_id) alone."""

from typing import Annotated

from fastapi import Depends, Path

from server import queries
from server.api.deps import DB


def resolve_run(db: DB, run_id: Annotated[str, Path(max_length=255, description="the run's id, a unique prefix "
                                                     "of it, or its unique name")]) -> str:
    with db.reading() as session:
        return queries.resolve_run_id(session, run_id)


RunRef = Annotated[str, Depends(resolve_run)]
