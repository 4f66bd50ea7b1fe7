"""What the advisor answers: typed, JSON-ready, and the shapes of the advice in the API's OpenAPI document."""

from pydantic import BaseModel, Field

from server.advisor.cost import CostModel
from server.advisor.engine import DraftingPublic, RoundTerms


class DepthSpeed(BaseModel):
    depth: int
    mean_accepted: float = Field(description="tokens accepted per round at this depth (tau)")
    round_ms: float
    tokens_per_second: float
    terms: RoundTerms | None = Field(None, description="the round's cost term by term (advice with an engine)")


class NoSpeculation(BaseModel):
    round_ms: float
    tokens_per_second: float


class FrontierRow(BaseModel):
    """One candidate TTT depth of a retrain: what it serves at, what it costs to train, when it pays."""

    ttt: int
    depth: int = Field(description="the depth to serve after a retrain at this TTT")
    tokens_per_second: float
    gain: float = Field(description="tokens_per_second / tokens_per_second now - 1")
    training_seconds: float | None = Field(None, description="the retrain's predicted duration (the dry run's)")
    training_hours: float | None = None
    gpu_hours: float | None = Field(None, description="training_hours x the GPUs the run trains on")
    extra_gpu_hours: float | None = Field(None, description="gpu_hours less finishing the current attempt")
    break_even_tokens: float | None = Field(
        None, description="tokens served until the extra training GPU-time is won back by the serving GPU-time "
        "saved: extra_gpu_hours x 3600 / (tp x (1/tokens_per_second_now - 1/tokens_per_second)); 0 when the "
        "retrain costs no more than finishing; none when it serves no faster")
    net_gpu_hours: float | None = Field(None, description="with serve_tokens: serving GPU-hours saved over them less "
                                        "extra_gpu_hours")
    net_value: float | None = Field(None, description="with GPU-hour prices: serving saved x its price less the "
                                    "extra training x its price")


class Objective(BaseModel):
    """What a retrain is judged by: the tokens the draft will serve over its life, optionally GPU-hour prices."""

    serve_tokens: float | None = Field(None, ge=0, description="tokens the draft will serve over its life")
    train_gpus: int = Field(1, ge=1, description="GPUs the retrain runs on")
    remaining_seconds: float = Field(0.0, ge=0, description="what finishing the current attempt would still take")
    train_gpu_hour_price: float | None = Field(None, ge=0)
    serve_gpu_hour_price: float | None = Field(None, ge=0)


class RetrainAdvice(BaseModel):
    """Whether training the draft with a deeper TTT would speed up serving, and when it pays for itself."""

    trained_ttt: int | None
    suggested_ttt_steps: int | None = None
    depth_after: int | None = None
    tokens_per_second_now: float
    tokens_per_second_after: float | None = None
    gain: float | None = Field(None, description="tokens_per_second_after / tokens_per_second_now - 1")
    predicted_training_seconds: float | None = None
    training_seconds_basis: str | None = None
    break_even_tokens: float | None = Field(None, description="generated tokens after which the retrain has paid off")
    pays_off: bool = False
    reason: str = ""
    assumption: str
    objective: str = Field("", description="how the TTT was picked among the frontier's")
    frontier: list[FrontierRow] = Field(default_factory=list, description="every candidate TTT beyond the trained "
                                        "one, with its serving speed, training cost and break-even")


class Advice(BaseModel):
    """Expected tokens/s per speculation depth on one interconnect, the depth to serve, and the retrain advice."""

    interconnect: str
    tp: int
    recommended_depth: int = Field(description="0: do not speculate")
    tokens_per_second: float
    speedup_vs_no_speculation: float
    no_speculation: NoSpeculation
    by_depth: list[DepthSpeed]
    allreduce_basis: str = Field(description="what the all-reduce times rest on")
    retrain: RetrainAdvice
    cost_model: CostModel
    drafting: DraftingPublic | None = Field(None, description="how the serving engine runs the draft, when given")


class InterconnectComparison(BaseModel):
    """advise() for NVLink and PCIe with the same measurements."""

    tp: int
    recommended_depth: dict[str, int]
    nvlink: Advice
    pcie: Advice
    note: str | None = Field(None, description="set when PCIe gets a shallower depth than NVLink, saying why")
