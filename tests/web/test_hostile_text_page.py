"""The run page in a real browser with what a job or an older server left: a diverged loss (NaN) shown as such and
said in the run's message; a name holding a bidi override (U+202E, stored before the API refused it) isolated in a
<bdi> so that it cannot reorder the text around it; a log line's override shown as `<U+202E>`."""

from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from server.db import Database
from server.models import Run
from tests.service import STUB_ENV, Service
from tests.web.conftest import sign_in

pytestmark = pytest.mark.slow  # a real server, a job and Chromium

JOB = """
import os, sys, time
if os.environ.get("RANK", "0") == "0":
    print("step 2 \\u202essol 2.0", flush=True)
    with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
        f.write('{"step": 1, "total_steps": 10, "loss_0": 2.0}\\n{"step": 2, "loss_0": NaN}\\n')
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""
NAME = "report\u202etxt.exe"


def test_a_nan_loss_and_a_bidi_override_are_shown_for_what_they_are(web: Service, page: Page, tmp_path: Path) -> None:
    job, stop = tmp_path / "job.py", tmp_path / "stop"
    job.write_text(JOB)
    run = web.submit({"name": "plain", "host": "local", "nproc_per_node": 1, "entrypoint": str(job),
                      "args": [str(stop)], "env": STUB_ENV})
    try:
        web.wait(run["id"], lambda r: r["latest"].get("loss_0") == "NaN", what="the NaN loss")
        db = Database(f"sqlite:///{web.home / 'longrun.db'}")
        with db.writing() as s:
            s.get(Run, run["id"]).name = NAME  # as an older server let it in
        db.dispose()
        sign_in(page, web)
        row = page.locator(f"#runs tr[data-run-id='{run['id']}']")
        expect(row.locator("bdi", has_text="txt.exe")).to_have_text(NAME)
        row.locator("a").click()
        expect(page.locator("h1 bdi").first).to_have_text(NAME)
        assert page.evaluate("getComputedStyle(document.querySelector('h1 bdi')).unicodeBidi") == "isolate"
        expect(page.locator("#last-loss")).to_have_text("NaN")
        expect(page.locator("#last-loss")).to_have_class("warn")
        expect(page.locator(".run-header .message")).to_contain_text("loss_0 is NaN at step 2: the training has diverged")
        expect(page.locator("#log")).to_contain_text("step 2 <U+202E>ssol 2.0")
        assert page.errors == []  # type: ignore[attr-defined]
    finally:
        stop.touch()
