"""A run on a host without GPUs: the page says so once instead of GPU charts that wait for points forever."""

from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.service import Service, kill_leftovers, toy_spec
from tests.web.conftest import TOKEN, sign_in, wait_for_points

pytestmark = pytest.mark.slow  # a real server, torchrun and Chromium


def test_a_host_without_gpus_gets_a_note_and_no_gpu_charts(tmp_path: Path, page: Page) -> None:
    svc = Service(tmp_path / "home", token=TOKEN, gpu_sample_interval=0.5)
    svc.home.mkdir()
    svc.start()
    try:
        run = svc.submit(toy_spec(steps=400, sleep=0.1, nproc=1))
        svc.wait(run["id"], lambda r: "loss" in r["latest"], what="a first loss")
        sign_in(page, svc, f"#/runs/{run['id']}")
        wait_for_points(page, "loss", 1)
        expect(page.locator("#gpu-note")).to_contain_text("local has no usable GPU", timeout=30_000)
        expect(page.locator("#chart-gpu-util")).to_be_hidden()
        expect(page.locator("#chart-gpu-mem")).to_be_hidden()
        expect(page.locator("#chart-loss")).to_be_visible()
        # a run without loss_0 (its own trainer) charts its `loss`
        expect(page.locator("#chart-loss .u-title")).to_have_text("Loss")
        assert page.errors == []  # type: ignore[attr-defined]
        svc.client.post(f"/v1/runs/{run['id']}/cancel")
        svc.wait_status(run["id"], "cancelled", timeout=60)
    finally:
        svc.stop()
        kill_leftovers(svc.workspace)
