"""How long a fresh attempt at another TTT depth would train: the restart dry run's prediction (server/eta.py) for
each depth. The depth proposal (server/proposal.py) and a run's advice (server/queries.py) both weigh a retrain by
it."""

from server import eta
from server.spec import RunCreate


def with_ttt(spec: RunCreate, ttt: int) -> RunCreate:
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"ttt_steps": ttt})})


def retrain_seconds(measured: list[eta.Measured], spec: RunCreate, depths: int) -> dict[int, float]:
    """The dry run's predicted duration for a fresh attempt at each TTT depth 1..depths (measured pace)."""
    out = {}
    if spec.trainer and measured:
        for ttt in range(1, depths + 1):
            seconds, _ = eta.predict_duration(measured, with_ttt(spec, ttt))
            if seconds is not None:
                out[ttt] = seconds
    return out
