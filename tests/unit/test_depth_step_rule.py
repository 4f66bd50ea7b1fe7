"""The retrain rule on step rates (sim_step_acc_k: no survivor bias) and the Wilson interval the proposal puts on a
simulated rate."""

import pytest

from server.advisor import rule_record
from server.advisor.depth import improved_positions, lifted_positions
from server.advisor.evidence import products, wilson

# the survivor-biased conditional rates climb past TTT=3; the rule on them sees nothing to lift
BIASED = products([0.9, 0.85, 0.84, 0.88, 0.87, 0.86])


def test_without_step_rates_a_climbing_conditional_rate_hides_the_fall_and_nothing_is_lifted() -> None:
    assert improved_positions(BIASED, 3) == BIASED


@pytest.fixture
def unbounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule as it reads the decay, without the record's bound on the acceptance a lift may reach."""
    monkeypatch.setattr(rule_record, "HIGHEST_ACCEPTANCE", 1.0)


@pytest.mark.usefixtures("unbounded")
def test_step_rates_that_fall_past_ttt_are_lifted_to_the_decay_kept_inside_it() -> None:
    falling = [0.9, 0.8, 0.72, 0.5, 0.4, 0.3]
    after = improved_positions(BIASED, 3, falling)
    assert after[:3] == BIASED[:3], "positions up to the trained depth do not change"
    assert all(a > b for a, b in zip(after[3:], BIASED[3:], strict=True))
    # a retrain at TTT=4 lifts position 4 only; beyond it the measured conditional rates ride on the lifted prefix
    at4 = lifted_positions(BIASED, 3, 4, falling)
    assert at4[3] == after[3] and at4[4] / at4[3] == pytest.approx(BIASED[4] / BIASED[3])


def test_step_rates_that_keep_the_inside_decay_leave_the_draft_as_it_is() -> None:
    # u_T = 0.72, r_u = (0.72 / 0.9)^(1/2) = 0.894: 0.644, 0.576, 0.515 is the decay; these are at or above it
    steady = [0.9, 0.8, 0.72, 0.66, 0.6, 0.55]
    assert improved_positions(BIASED, 3, steady) == BIASED


@pytest.mark.usefixtures("unbounded")
def test_step_rates_rising_inside_the_trained_depth_do_not_promise_better_than_its_last() -> None:
    rising = [0.6, 0.7, 0.8, 0.5, 0.5, 0.5]  # r_u would be 1.15: capped at 1, the target stays 0.8
    after = improved_positions(BIASED, 3, rising)
    conditional = [a / b for a, b in zip(after[3:], after[2:], strict=False)]
    assert conditional == pytest.approx([min(1.0, c * 0.8 / 0.5) for c in (0.88, 0.87, 0.86)])


def test_no_position_is_lifted_above_the_acceptance_the_rules_record_measured() -> None:
    # a draft that falls to 0.02 past TTT=3: the old rule lifted position 4 to 1.0 (0.72 x 0.8 / 0.02, capped)
    shallow = products([0.9, 0.85, 0.84, 0.3, 0.3, 0.3])
    after = improved_positions(shallow, 3, [0.9, 0.8, 0.72, 0.02, 0.02, 0.02])
    conditional = [a / b for a, b in zip(after[3:], after[2:], strict=False)]
    assert conditional == pytest.approx([rule_record.HIGHEST_ACCEPTANCE] * 3)
    # a rate measured above the bound keeps its own value: nothing is lowered
    assert improved_positions(BIASED, 3, [0.9, 0.8, 0.72, 0.5, 0.4, 0.3]) == BIASED


def test_wilson_intervals_narrow_with_rounds_and_stay_inside_0_and_1() -> None:
    assert wilson(0.5, 0) is None
    wide, narrow = wilson(0.5, 60), wilson(0.5, 100_000)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    assert narrow[1] - narrow[0] == pytest.approx(2 * 1.6449 * (0.25 / 100_000) ** 0.5, rel=1e-3)
    low, high = wilson(1.0, 20)
    assert 0.8 < low < 1.0 and high == 1.0
