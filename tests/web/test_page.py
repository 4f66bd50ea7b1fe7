"""The page at `/` in a real browser: a live run's charts grow, restart shows the dry run then attempt 2,
cancel ends the run; the token is asked for and never put in a URL; run names are shown as text."""

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, Request, expect

from tests.inprocess import App
from tests.service import Service, toy_spec
from tests.web.conftest import TOKEN, hold_gpu, sign_in, wait_for_points

pytestmark = pytest.mark.slow  # a real server, torchrun and Chromium


def test_the_page_and_its_files_need_no_token_but_every_data_call_does(tmp_path: Path, database_url: str) -> None:
    guarded = App(tmp_path / "home", database_url, token=TOKEN)
    try:
        bare = guarded.client.__class__(guarded.app, base_url=str(guarded.client.base_url))  # no token
        page = bare.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        for path in re.findall(r'(?:src|href)="(/web/[^"]+)"', page.text):
            assert bare.get(path).status_code == 200, path
        assert bare.get("/web/app.js").headers["content-type"].startswith(("text/javascript", "application/javascript"))
        assert "MIT License" in bare.get("/web/vendor/uplot/LICENSE").text
        assert bare.get("/v1/runs").status_code == 401
        assert bare.get("/metrics").status_code == 401
    finally:
        guarded.close()


def test_a_live_run_charts_as_metrics_arrive_with_the_token_kept_out_of_urls(web: Service, page: Page) -> None:
    nasty = '<img src=x onerror="window.pwned=1">toy'
    run = web.submit(toy_spec(steps=400, sleep=0.1, name=nasty))
    urls: list[str] = []
    authorized: list[bool] = []

    def seen(request: Request) -> None:
        urls.append(request.url)
        if "/v1/" in request.url:
            authorized.append(request.headers.get("authorization") == f"Bearer {TOKEN}")

    page.on("request", seen)
    sign_in(page, web)
    row = page.locator(f"#runs tr[data-run-id='{run['id']}']")
    expect(row).to_contain_text(nasty)  # shown as text
    expect(row.locator(".badge")).to_have_text(re.compile("queued|launching|running"))
    assert page.locator("#runs img").count() == 0 and page.evaluate("window.pwned") is None
    assert authorized[0] is False, "the first call went without a token, and its 401 asked for one"
    authorized.clear()

    row.locator("a").click()
    expect(page.locator("h1")).to_contain_text(nasty)
    first = wait_for_points(page, "loss", 0)
    grown = wait_for_points(page, "loss", first + 10)
    assert grown > first, "the loss chart gains points while the run trains"
    expect(page.locator("#progress")).to_contain_text(re.compile(r"\d+\.\d%"))
    expect(page.locator("#eta")).not_to_have_text("—")
    expect(page.locator("#log")).to_contain_text("world size 2")
    hold_gpu(web, web.run(run["id"]), 64)
    wait_for_points(page, "gpu-util", 2)
    wait_for_points(page, "gpu-mem", 2)
    expect(page.locator("#chart-gpu-util .u-legend")).to_contain_text("gpu_util_0 · attempt 1")
    page.select_option("#x-axis", "time")
    assert wait_for_points(page, "loss", 0) >= grown, "over time, the same points"

    assert any("/events" in u for u in urls), "the page follows the run's event stream"
    assert authorized and all(authorized), "every data call carries the bearer token"
    assert not any(TOKEN in u for u in urls + [page.url]), "the token never goes into a URL"
    assert page.errors == []  # type: ignore[attr-defined]


def test_restart_shows_the_dry_run_prediction_then_a_second_attempt_and_cancel_ends_it(
        web: Service, page: Page) -> None:
    run = web.submit(toy_spec(steps=600, sleep=0.1))
    sign_in(page, web, f"#/runs/{run['id']}")
    wait_for_points(page, "loss", 5)

    page.click("#restart-form summary")
    page.fill("#restart-args", "--steps 900 --sleep 0.1 --label second")
    page.click("#restart-preview")
    expect(page.locator("#predicted-duration")).to_have_text(re.compile(r"^\d+(s|m \d+s|h \d+m)$"))
    expect(page.locator("#restart-prediction .changes")).to_contain_text('args: ["--steps","600"')
    assert web.run(run["id"])["attempt"] == 1, "the prediction changes nothing"
    page.fill("#restart-args", "--steps 900 --sleep 0.1 --label second!")
    expect(page.locator("#restart-confirm")).to_be_disabled()  # a changed form needs a new prediction
    page.click("#restart-preview")
    page.click("#restart-confirm")

    expect(page.locator("#attempts tr[data-attempt='2']")).to_contain_text("--label")
    expect(page.locator("#attempt")).to_have_text("2")
    page.wait_for_function("() => document.querySelector('#chart-loss').textContent.includes('attempt 2')", timeout=90_000)
    assert web.run(run["id"])["attempts"][1]["spec"]["args"][-1] == "second!"
    expect(page.locator("#log")).to_contain_text("attempt 2", timeout=60_000)
    expect(page.locator("#log")).to_contain_text("second!", timeout=60_000)

    page.on("dialog", lambda dialog: dialog.accept())
    page.click("#cancel")
    expect(page.locator("h1 .badge")).to_have_text("cancelled", timeout=60_000)
    expect(page.locator("#cancel")).to_be_disabled()
    assert web.run(run["id"])["status"] == "cancelled"
    assert page.errors == []  # type: ignore[attr-defined]


def test_the_list_filters_by_state(web: Service, page: Page) -> None:
    done = web.submit(toy_spec(steps=3, sleep=0.01, nproc=1, name="short"))
    web.wait_status(done["id"], "succeeded")
    running = web.submit(toy_spec(steps=2000, sleep=0.1, nproc=1, name="long"))
    web.wait_status(running["id"], "running")
    sign_in(page, web)
    expect(page.locator("#runs tbody tr[data-run-id]")).to_have_count(2)
    page.select_option("#state-filter", "running")
    expect(page.locator("#runs tbody tr[data-run-id]")).to_have_count(1)
    expect(page.locator("#runs tbody")).to_contain_text("long")
    assert "state=running" in page.url
    web.client.post(f"/v1/runs/{running['id']}/cancel")
