from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.api.deps import DB
from server.metrics_export import registry_for

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                             "description": "Prometheus text exposition, read from the database now"}})
def prometheus_metrics(db: DB) -> Response:
    """Runs by state, attempts, retries, hosts, ingested points, and each running run's pace, progress and GPUs."""
    return Response(generate_latest(registry_for(db)), media_type=CONTENT_TYPE_LATEST)
