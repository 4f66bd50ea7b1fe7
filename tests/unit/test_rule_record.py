"""The retrain rule's measured record (server/advisor/rule_record.py), as shipped: where it missed past 10% a
restart like it is not proposed; where it held, or was never measured, the answer says so."""

from server.advisor import rule_record


def test_the_shipped_record_distrusts_restarts_from_ttt_3_where_the_larger_verifier_missed():
    trusted, why = rule_record.judge(3, 5, "pcie")
    assert not trusted
    assert "missed by +11.9% on a restart like this one" in why and "base (246M)" in why
    assert rule_record.judge(3, 5, "nvlink")[0] is False  # +10.3% there
    assert rule_record.judge(1, 3, "nvlink")[0] is False  # +91.0% on the demo's verifier


def test_a_restart_within_its_record_is_trusted_and_one_never_measured_says_so():
    trusted, why = rule_record.judge(5, 7, "pcie")
    assert trusted and "held within 10% on the 1 restart(s) like this one measured (worst +8.7%" in why
    trusted, why = rule_record.judge(2, 4, "pcie")
    assert trusted and "was not measured for a restart from TTT=2 to 4" in why


def test_the_record_on_the_way_to_the_proposed_ttt_counts_and_an_unknown_link_reads_every_link():
    # from 3 to 4: nothing measured that shallow; to 6, the 3 → 5 rows count
    assert rule_record.record_for(3, 4, "pcie") == []
    assert {c.to_ttt for c in rule_record.record_for(3, 6, "pcie")} == {5}
    assert {c.interconnect for c in rule_record.record_for(3, 7, "unknown")} == {"nvlink", "pcie"}
