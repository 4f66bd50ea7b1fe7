"""The retrain rule's measured record (server/advisor/rule_record.py): where it missed past 10% a restart like it is
not proposed; where it held, or was never measured, the answer says so. Judged on the toy verifiers' rows (the
fallback), which stay put when the SmolLM2 rows are pasted."""

from server.advisor import rule_record

TOY = rule_record.TOY_FALLBACK


def test_the_shipped_record_distrusts_restarts_from_ttt_3_where_the_larger_verifier_missed():
    trusted, why = rule_record.judge(3, 5, "pcie", TOY)
    assert not trusted
    assert "missed by +11.9% on a restart like this one" in why and "base (246M)" in why
    assert rule_record.judge(3, 5, "nvlink", TOY)[0] is False  # +10.3% there
    assert rule_record.judge(1, 3, "nvlink", TOY)[0] is False  # +91.0% on the demo's verifier


def test_a_restart_within_its_record_is_trusted_and_one_never_measured_says_so():
    trusted, why = rule_record.judge(5, 7, "pcie", TOY)
    assert trusted and "held within 10% on the 1 restart(s) like this one measured (worst +8.7%" in why
    trusted, why = rule_record.judge(2, 4, "pcie", TOY)
    assert trusted and "was not measured for a restart from TTT=2 to 4" in why


def test_the_record_on_the_way_to_the_proposed_ttt_counts_and_an_unknown_link_reads_every_link():
    # from 3 to 4: nothing measured that shallow; to 6, the 3 → 5 rows count
    assert rule_record.record_for(3, 4, "pcie", TOY) == []
    assert {c.to_ttt for c in rule_record.record_for(3, 6, "pcie", TOY)} == {5}
    assert {c.interconnect for c in rule_record.record_for(3, 7, "unknown", TOY)} == {"nvlink", "pcie"}


def test_the_record_the_proposal_reads_is_smollm2s_once_pasted_and_the_labelled_toy_fallback_until_then():
    if rule_record.SMOLLM2:
        assert rule_record.MEASURED == rule_record.SMOLLM2 and "SmolLM2" in rule_record.SOURCE
    else:
        assert rule_record.MEASURED == TOY and "toy" in rule_record.SOURCE and "fallback" in rule_record.SOURCE
    assert all(c.verifier.startswith("toy: ") for c in TOY)
