"""The retrain rule's record: what it predicted for restarts at a deeper TTT against the deeper drafts actually
trained and decoded, so that a proposal says "cannot tell" where the rule has missed.

`benchmarks/depth_experiment.py` trains drafts at TTT 1, 3, 5 and 7 on identical steps and decodes each out to depth
16; for each draft and each deeper TTT the experiment also trained, it compares the tokens/s the rule predicted for
that restart (the advisor's frontier) with the deeper draft's own decoding at the depth it would serve (its
`prediction_check`). Those rows are copied here, with the verifier and the data they came from (docs/benchmarks.md
has the tables, the command and the machine). A proposal to restart from TTT=T to TTT=N reads the rows from T to
every TTT up to N (the rule's track record on the way there): where one missed by more than MISS, the rule is not
trusted to price this restart and the proposal says it cannot tell; where none was measured, it says so.
"""

from __future__ import annotations

from dataclasses import dataclass

MISS = 0.10


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


SOURCE = "the depth experiment (benchmarks/depth_experiment.py, docs/benchmarks.md)"

MEASURED: tuple[Checked, ...] = ()


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
