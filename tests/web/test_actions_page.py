"""The page deletes an ended run and edits a host (DELETE /v1/runs/{id}, PATCH /v1/hosts/{name}); a restart that
starts over is drawn from step 0 over the attempt before it; the runs list says which loss it shows."""

import json
import os
import sys
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.service import Service, toy_spec
from tests.web.conftest import sign_in

pytestmark = pytest.mark.slow  # a real server, torchrun and Chromium



def screenshot(locator, name: str) -> None:
    """A picture of what the test saw, in LONGRUN_TEST_PICTURES when it is set (LONGRUN_SCREENSHOTS is the docs'
    folder, which tests/web/test_trainer_page.py fills)."""
    if os.environ.get("LONGRUN_TEST_PICTURES"):
        locator.screenshot(path=str(Path(os.environ["LONGRUN_TEST_PICTURES"]) / name))


def test_a_fresh_attempt_is_drawn_from_step_0_and_an_ended_run_is_deleted_from_the_page(web: Service, page: Page) -> None:
    run = web.submit(toy_spec(steps=30, sleep=0.02, nproc=1, name="fresh-restart"))
    web.wait(run["id"], lambda r: r["status"] == "succeeded", what="attempt 1 done")
    assert web.client.post(f"/v1/runs/{run['id']}/restart", json={}).status_code == 202
    web.wait(run["id"], lambda r: r["status"] == "succeeded" and r["attempt"] == 2, what="attempt 2 done")
    sign_in(page, web, f"#/runs/{run['id']}")
    page.wait_for_function("() => JSON.parse(document.querySelector('#chart-loss')?.dataset.markers || '[]').length")
    markers = json.loads(page.get_attribute("#chart-loss", "data-markers"))
    assert markers[0]["label"] == "attempt 2" and markers[0]["x"] <= 1  # from the start, not after step 30
    screenshot(page.locator("#charts"), "fresh-attempt.png")
    expect(page.locator("#summary")).to_contain_text("Last loss (TTT step 0)")
    page.on("dialog", lambda dialog: dialog.accept())
    expect(page.locator("#delete")).to_be_enabled()
    page.click("#delete")
    page.wait_for_url("**/#/")
    expect(page.locator("#runs thead")).to_contain_text("Last loss (TTT step 0)")
    expect(page.locator("#runs tbody")).to_contain_text("no runs yet")
    assert web.client.get(f"/v1/runs/{run['id']}").status_code == 404


def test_a_live_run_cannot_be_deleted_and_a_host_is_edited_on_the_hosts_page(web: Service, page: Page) -> None:
    run = web.submit(toy_spec(steps=100_000, sleep=0.05, nproc=1, name="live"))
    web.wait(run["id"], lambda r: r["status"] == "running", what="running")
    sign_in(page, web, f"#/runs/{run['id']}")
    expect(page.locator("#delete")).to_be_disabled()
    web.client.post(f"/v1/runs/{run['id']}/cancel")
    page.click("#nav-hosts")
    card = page.locator("[data-host=local]")
    expect(card).to_contain_text("local")
    card.locator("summary").click()
    python = card.locator("input[name=python]")
    other = "python3" if python.input_value() == sys.executable else sys.executable  # a python that is there
    python.fill(other)
    card.locator("button.host-save").click()
    expect(card).to_contain_text("saved: python")
    assert web.client.get("/v1/hosts/local").json()["python"] == other
    screenshot(page.locator("main"), "hosts-page.png")
