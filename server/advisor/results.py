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
