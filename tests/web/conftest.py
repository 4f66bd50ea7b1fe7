"""A real Chromium (Debian's, headless) driven by Playwright, against a real `longrun serve` with a token."""

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.service import Service, serve_with_fake_gpus
from tests.trainer.conftest import prepared_data, tiny_corpus, tiny_verifier  # noqa: F401  (fixtures)

TOKEN = "web-s3cret"
# the system browser: Playwright's own download is not needed (nor reachable on air-gapped machines)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail("the browser tests need Debian's chromium: `sudo apt-get install chromium` (make system-deps)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def web(tmp_path: Path) -> Iterator[Service]:
    """The server, its `nvidia-smi` the two-H200 stand-in (tests/fakegpu); `svc.gpu_state` says who holds GPUs."""
    for svc, state in serve_with_fake_gpus(tmp_path, token=TOKEN, gpu_sample_interval=0.5):
        svc.gpu_state = state  # type: ignore[attr-defined]
        yield svc


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.errors = []  # type: ignore[attr-defined]
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))  # type: ignore[attr-defined]
    # what the Content-Security-Policy blocks is no page error, only a console one: count it as one
    tab.on("console", lambda message: tab.errors.append(message.text)  # type: ignore[attr-defined]
           if message.type == "error" and "Content Security Policy" in message.text else None)
    tab.set_default_timeout(60_000)
    yield tab
    context.close()


def sign_in(page: Page, svc: Service, fragment: str = "#/") -> None:
    """Open the page, which asks for the token (every data call is a 401 without it), and give it."""
    page.goto(f"{svc.url}/{fragment}")
    page.wait_for_selector("#token-dialog[open]")
    page.fill("#token-input", TOKEN)
    page.click("#token-dialog button[type=submit]")


def hold_gpu(svc: Service, run: dict, utilization: int) -> None:
    """Have the fake nvidia-smi report the run's current attempt on GPU 0 at `utilization` percent: whichever of its
    processes lives at each sample (none once it ended; on a loaded machine it may end before the test gets here)."""
    attempt = next(a for a in run["attempts"] if a["number"] == run["attempt"])
    holder = f"env:LONGRUN_ATTEMPT_DIR={attempt['nodes'][0]['dir']}"
    svc.gpu_state.write_text(json.dumps({"holders": {"0": holder}, "util": utilization}))  # type: ignore[attr-defined]


def release_gpus(svc: Service) -> None:
    """Nobody holds a GPU (a holder left listed after its run ended would keep the next attempt waiting)."""
    svc.gpu_state.write_text(json.dumps({"holders": {}, "util": 0}))  # type: ignore[attr-defined]


def chart_points(page: Page, chart: str) -> int:
    return int(page.get_attribute(f"#chart-{chart}", "data-points") or 0)


def wait_for_points(page: Page, chart: str, more_than: int, timeout: float = 90_000) -> int:
    page.wait_for_function(f"() => Number(document.querySelector('#chart-{chart}')?.dataset.points || 0) > {more_than}",
                           timeout=timeout)
    return chart_points(page, chart)
