"""The proposal panel in a real browser: a TTT=3 run whose validation says a deeper TTT pays off on its deploy
host; its one button opens the restart form pre-filled (TTT, clean) with the dry run's duration shown first. The
panel names the evidence that decided with its interval, and the evaluation panel says the proposal's verdict.

The API is the in-process app served over HTTP by uvicorn, without the worker: the run's metric lines go through
the worker's ingest (worker/ingest.py) as a trainer writes them, and the deploy host's all-reduce table is the
InterconnectResponder's probe of `local` with tests/fakegpu's captured H200 sweep."""

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import uvicorn
from playwright.sync_api import Page, expect

from server.models import Attempt, utcnow
from tests.inprocess import App
from tests.server.test_interconnect_api import fake_host_env, probe, responder  # noqa: F401 - fixtures
from tests.server.test_proposal import SHALLOW, feed, trainer_run, validate
from tests.server.test_proposal_evidence import DECODED, FALLING, SIM, evaluation, with_counts
from tests.service import free_port
from tests.web.conftest import TOKEN, sign_in
from worker.interconnect import InterconnectResponder

pytestmark = pytest.mark.slow  # Chromium


@pytest.fixture
def api(tmp_path: Path, database_url: str) -> Iterator[App]:
    app = App(tmp_path / "home", database_url, token=TOKEN)
    yield app
    app.close()


@pytest.fixture(autouse=True)
def proposal_clock_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proposal's clock stopped at the test's start: its price against finishing the attempt counts the attempt's
    ETA down by the wall clock, so the summary the test reads from the API and the one the page reads later differed
    in a last digit on a loaded machine (+1.83 against +1.84 GPU-h, beside stress -c 8)."""
    now = utcnow()
    monkeypatch.setattr("server.advisor.proposing.utcnow", lambda: now)


@pytest.fixture
def served(api: App) -> Iterator[SimpleNamespace]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}")
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.usefixtures("fake_host_env", "rule_trusted")  # a restart proposal, once made (tests/conftest.py)
def test_the_proposals_button_opens_the_restart_form_pre_filled_with_its_dry_run(
        api: App, responder: InterconnectResponder, served: SimpleNamespace, page: Page) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    proposal = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    ttt = proposal["suggested_ttt"]

    sign_in(page, served, f"#/runs/{run_id}")
    expect(page.locator("#proposal-summary")).to_have_text(proposal["summary"])
    expect(page.locator("#proposal-restart")).to_have_text(f"Restart at TTT={ttt}…")
    expect(page.locator("#proposal-rule-record")).to_have_text(proposal["rule_record"])  # how the rule held
    page.click("#proposal-restart")

    expect(page.locator("#restart-form")).to_have_attribute("open", "")
    expect(page.locator("#restart-ttt")).to_have_value(str(ttt))
    expect(page.locator("#restart-start-from")).to_have_value("fresh")
    expect(page.locator("#predicted-duration")).to_have_text(re.compile(r"^\d+(s|m \d+s|h \d+m)$"))
    expect(page.locator("#predicted-duration")).to_have_text(page.locator("#proposal-duration").inner_text())
    expect(page.locator("#restart-prediction")).to_contain_text(f"trainer.ttt_steps: 3 → {ttt}")
    expect(page.locator("#restart-prediction")).to_contain_text("The output directory will be emptied.")
    expect(page.locator("#restart-confirm")).to_be_enabled()
    assert api.client.get(f"/v1/runs/{run_id}").json()["attempt"] == 1, "the button and its dry run change nothing"

    # with a TTT=3 checkpoint in the output dir (mid-epoch), the trainer's own start is refused until resume is chosen
    with api.session() as s:
        attempt = s.query(Attempt).filter_by(run_id=run_id).one()
        attempt.last_step, attempt.total_steps = 1000, 2000
        attempt.spec = {**attempt.spec, "trainer": {**attempt.spec["trainer"], "save_every": 500}}
    page.select_option("#restart-start-from", "")
    page.click("#restart-preview")
    expect(page.locator("#restart-prediction .error")).to_contain_text("was trained with 3 TTT steps")
    expect(page.locator("#restart-confirm")).to_be_disabled()
    page.select_option("#restart-start-from", "resume")
    page.click("#restart-preview")
    expect(page.locator("#restart-start")).to_contain_text("Start: resume: resumes the checkpoint at step 1000")
    expect(page.locator("#restart-confirm")).to_be_enabled()
    assert page.errors == []  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fake_host_env", "rule_unbounded")  # the evidence's figures, not the record's bounds
def test_the_page_says_the_proposals_one_verdict_with_the_evidence_that_decided_and_its_interval(
        api: App, responder: InterconnectResponder, served: SimpleNamespace, page: Page) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
    url = f"/v1/runs/{run_id}/proposal"
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    # step rates falling past TTT=3 over too few rounds to say: cannot tell yet
    feed(api, run_id, 1, {"step": 100, "val_loss": 1.0, **with_counts(SIM, FALLING, 60)})
    unsure = api.client.get(url).json()
    assert unsure["action"] == "cannot_tell", unsure["summary"]
    low, high = unsure["evidence"]["gain_interval"]

    sign_in(page, served, f"#/runs/{run_id}")
    expect(page.locator("#proposal-verdict")).to_have_text("cannot tell yet")
    expect(page.locator("#proposal-summary")).to_have_text(unsure["summary"])
    expect(page.locator("#proposal-evidence-source")).to_have_text(
        "simulation (60 validation rounds), not yet checked against decoding")
    expect(page.locator("#proposal-interval")).to_contain_text(f"gain +{low * 100:.1f}% to +{high * 100:.1f}%")
    expect(page.locator("#proposal-decay")).to_contain_text("reads sim_step_acc_k")
    expect(page.locator("#proposal-settle")).to_have_text(unsure["evidence"]["settle"])
    expect(page.locator("#proposal-restart")).to_have_count(0)

    # the attempt's evaluation: decoding decides, and the evaluation panel says the proposal's verdict, not the
    # advice's own "pays off"
    feed(api, run_id, 2, evaluation(DECODED) | {"step": 100})
    decided = api.client.get(url).json()
    assert decided["evidence"]["source"] == "decoding"
    said = {"restart": f"restart at TTT={decided['suggested_ttt']}", "keep_going": "keep going",
            "cannot_tell": "cannot tell yet", "probe": "probe first"}[decided["action"]]
    page.reload()
    expect(page.locator("#proposal-summary")).to_have_text(decided["summary"])
    expect(page.locator("#proposal-evidence-source")).to_contain_text("decoding (attempt 1's evaluation")
    verdict = page.locator("#evaluation-verdict")
    expect(verdict).to_contain_text(f"Retrain: {said}")
    expect(verdict).to_contain_text("(the run's proposal, decided by decoding")
    expect(page.locator("#advice .advice").first).to_contain_text("Serve at depth")
    expect(page.locator("#evaluation-card")).not_to_contain_text("pays off")
    assert page.errors == []  # type: ignore[attr-defined]


def test_the_restart_form_says_when_the_attempt_is_in_its_final_evaluation(
        api: App, served: SimpleNamespace, page: Page) -> None:
    """Its last step trained, the attempt evaluates: the form's dry run says a restart now stops that, before the
    confirm (the command waits for it, or asks)."""
    run_id = trainer_run(api)
    feed(api, run_id, 0, {"step": 1000, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    sign_in(page, served, f"#/runs/{run_id}")
    page.click("#restart-form summary")
    page.fill("#restart-ttt", "5")
    page.select_option("#restart-start-from", "fresh")
    page.click("#restart-preview")
    expect(page.locator("#restart-evaluating")).to_contain_text("is in its final evaluation: restarting now stops it")
    expect(page.locator("#restart-confirm")).to_be_enabled()
    assert api.client.get(f"/v1/runs/{run_id}").json()["attempt"] == 1, "nothing stopped before the confirm"
    assert page.errors == []  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fake_host_env")
def test_where_the_rules_record_missed_the_page_offers_the_probe_priced_and_takes_it(
        api: App, responder: InterconnectResponder, served: SimpleNamespace, page: Page,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    from server.advisor import rule_record

    monkeypatch.setattr(rule_record, "MEASURED", tuple(
        rule_record.Checked("tiny", "regenerated", "nvlink", 3, to, 0.2, 0.16, 0.25) for to in range(4, 8)))
    probe(api, responder, tp=2)
    run_id = trainer_run(api, deploy={"host": "local", "engine": "sglang"})
    feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
    validate(api, run_id, 1, 100, SHALLOW)
    offered = api.client.get(f"/v1/runs/{run_id}/proposal").json()
    assert offered["action"] == "probe", offered["summary"]
    ttt, steps = offered["probe"]["ttt"], offered["probe"]["steps"]

    sign_in(page, served, f"#/runs/{run_id}")
    expect(page.locator("#proposal-verdict")).to_have_text("probe first")
    expect(page.locator("#proposal-summary")).to_have_text(offered["summary"])
    expect(page.locator("#proposal-probe-plan")).to_contain_text(
        f"TTT={ttt} for {steps} steps from the checkpoint at step 0 (")
    expect(page.locator("#proposal-auto-restart")).to_have_text(f"on_proposal: {offered['auto_restart']}")
    expect(page.locator("#proposal-restart")).to_have_count(0)
    page.click("#proposal-probe-take")
    expect(page.locator("#proposal-probe-take")).to_have_count(0)  # under way: nothing more to take
    expect(page.locator("#proposal-probe-plan")).to_contain_text(f"TTT={ttt} for {steps} steps")
    run = api.client.get(f"/v1/runs/{run_id}").json()
    assert run["attempt"] == 2 and run["attempts"][-1]["spec"]["trainer"]["ttt_steps"] == ttt
    assert page.errors == []  # type: ignore[attr-defined]
