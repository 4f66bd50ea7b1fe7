"""The retrain rule's record: what it predicted for restarts at a deeper TTT against the deeper drafts actually
trained and decoded, so that a proposal says "cannot tell" where the rule has missed.

`benchmarks/depth_experiment.py` trains drafts at TTT 1, 3, 5 and 7 on identical steps and decodes each out to depth
16; for each draft and each deeper TTT the experiment also trained, it compares the tokens/s the rule predicted for
that restart (the advisor's frontier) with the deeper draft's own decoding at the depth it would serve (its
`prediction_check`, written as these rows in OUT/rule_record.txt). They are pasted here, with the verifier and the
data they came from (docs/benchmarks.md has the tables, the command and the machine). A proposal to restart from
TTT=T to TTT=N reads the rows from T to every TTT up to N (the rule's track record on the way there): where one
missed by more than MISS, the rule is not trusted to price this restart and the proposal says it cannot tell; where
none was measured, it says so.
"""

from __future__ import annotations

from dataclasses import dataclass

MISS = 0.10

# The evidence's bounds: no prediction past the deepest TTT a restart in the record was trained to, nor a position
# lifted above the highest conditional acceptance a deeper draft of the record measured at a position past the
# shallower draft's depth (docs/benchmarks.md, the depth experiment: regenerated TTT=5, position 5, 0.80). Both come
# from the rows below and move with them when the record is rebuilt from another verifier.
DEEPEST_MEASURED = 7
HIGHEST_ACCEPTANCE = 0.80


@dataclass(frozen=True)
class Checked:
    """One restart the rule priced, and what the deeper draft measured: gains over the shallower draft's tokens/s,
    miss = predicted tokens/s / measured - 1."""

    verifier: str
    data: str
    interconnect: str
    from_ttt: int
    to_ttt: int
    predicted_gain: float
    measured_gain: float
    miss: float


SOURCE = "the depth experiment of 2026-12-06 on one H100, docs/benchmarks.md"

# `python benchmarks/depth_experiment.py --size {tiny,base} --max-depth 16 --ttt 1,3,5,7 --regenerate yes`: the demo's
# verifier and one of 97 times its parameters, TTT 1, 3, 5 and 7 at 600 steps each, 32 held-out prompts decoded to
# depth 16, the advisor's 70B-class verifier at tp=8 on its NVLink and PCIe tables (results.json's prediction_check)
MEASURED: tuple[Checked, ...] = (
    Checked("demo tiny (2.5M)", "regenerated", "nvlink", 1, 3, 2.1428, 0.6452, 0.9102),
    Checked("demo tiny (2.5M)", "regenerated", "nvlink", 1, 5, 2.0414, 1.3705, 0.2830),
    Checked("demo tiny (2.5M)", "regenerated", "nvlink", 1, 7, 1.7887, 1.1392, 0.3036),
    Checked("demo tiny (2.5M)", "regenerated", "pcie", 1, 3, 2.7595, 0.9681, 0.9102),
    Checked("demo tiny (2.5M)", "regenerated", "pcie", 1, 5, 2.6382, 1.8356, 0.2830),
    Checked("demo tiny (2.5M)", "regenerated", "pcie", 1, 7, 2.3359, 1.5590, 0.3036),
    Checked("demo tiny (2.5M)", "regenerated", "nvlink", 3, 5, 0.0429, 0.0189, 0.0236),
    Checked("demo tiny (2.5M)", "regenerated", "nvlink", 3, 7, 0.0894, 0.1048, -0.0139),
    Checked("demo tiny (2.5M)", "regenerated", "pcie", 3, 5, 0.0465, 0.1301, -0.0740),
    Checked("demo tiny (2.5M)", "regenerated", "pcie", 3, 7, 0.1013, 0.1524, -0.0444),
    Checked("base (246M)", "regenerated", "nvlink", 1, 3, 0.1959, 0.0590, 0.1293),
    Checked("base (246M)", "regenerated", "nvlink", 1, 5, 0.1964, -0.0575, 0.2694),
    Checked("base (246M)", "regenerated", "nvlink", 1, 7, 0.1964, -0.1472, 0.4029),
    Checked("base (246M)", "regenerated", "pcie", 1, 3, 0.2394, 0.0976, 0.1293),
    Checked("base (246M)", "regenerated", "pcie", 1, 5, 0.2604, -0.0071, 0.2694),
    Checked("base (246M)", "regenerated", "pcie", 1, 7, 0.2604, -0.1016, 0.4029),
    Checked("base (246M)", "regenerated", "nvlink", 3, 5, 0.0000, -0.0930, 0.1026),
    Checked("base (246M)", "regenerated", "nvlink", 3, 7, 0.0000, -0.1656, 0.1985),
    Checked("base (246M)", "regenerated", "pcie", 3, 5, 0.0126, -0.0953, 0.1194),
    Checked("base (246M)", "regenerated", "pcie", 3, 7, 0.0126, -0.1814, 0.2371),
    Checked("base (246M)", "regenerated", "nvlink", 5, 7, 0.0000, -0.0800, 0.0870),
    Checked("base (246M)", "regenerated", "pcie", 5, 7, 0.0000, -0.0800, 0.0870),
)


def record_for(trained: int, proposed: int, interconnect: str | None = None,
               measured: tuple[Checked, ...] | None = None) -> list[Checked]:
    """The measured restarts from `trained` to a TTT above it and up to `proposed`, on `interconnect` where the
    record has it (else on every interconnect measured)."""
    rows = [c for c in (MEASURED if measured is None else measured)
            if c.from_ttt == trained and trained < c.to_ttt <= proposed]
    same_link = [c for c in rows if c.interconnect == interconnect]
    return same_link or rows


def judge(trained: int, proposed: int, interconnect: str | None = None,
          measured: tuple[Checked, ...] | None = None) -> tuple[bool, str]:
    """(whether the rule may be trusted to propose this restart, one clause saying why)."""
    rows = record_for(trained, proposed, interconnect, measured)
    if not rows:
        return True, (f"the retrain rule was not measured for a restart from TTT={trained} to {proposed} "
                      f"({SOURCE} holds none)")
    worst = max(rows, key=lambda c: abs(c.miss))
    what = (f"{worst.verifier} verifier, {worst.data} data, {worst.interconnect}: TTT={worst.from_ttt}→"
            f"{worst.to_ttt} predicted {worst.predicted_gain:+.1%}, measured {worst.measured_gain:+.1%}")
    if abs(worst.miss) > MISS:
        return False, (f"the retrain rule's prediction missed by {worst.miss:+.1%} on a restart like this one "
                       f"({what}; {len(rows)} measured, {SOURCE}), past the {MISS:.0%} it must hold to be trusted")
    return True, (f"the retrain rule held within {MISS:.0%} on the {len(rows)} restart(s) like this one measured "
                  f"(worst {worst.miss:+.1%}: {what}; {SOURCE})")
