"""The bundled trainer watched and restarted from the page: acc_k per TTT step live, the evaluation and the
advisor's answers, and a restart at TTT=5 (the form's first field) through the dry run into attempt 2. Beside the
page it checks the API's side of the same run (live metrics and ETA, the evaluation, the dry run's prediction, the
advice at TTT=5): the integration lane's served TTT=3 -> TTT=5 run was this run again, and is no longer run there.

With LONGRUN_SCREENSHOTS=DIR it also saves the runs list and the run page there (docs/ holds them)."""

import json
import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.service import Service, toy_spec
from tests.trainer.test_service_trainer import _trainer_spec
from tests.web.conftest import hold_gpu, release_gpus, sign_in, wait_for_points

pytestmark = pytest.mark.slow  # a real server running the trainer under torchrun, and Chromium


def legend(page: Page, chart: str) -> str:
    return page.locator(f"#chart-{chart} .u-legend").text_content() or ""


def screenshot(page: Page, name: str) -> None:
    if os.environ.get("LONGRUN_SCREENSHOTS"):
        page.screenshot(path=str(Path(os.environ["LONGRUN_SCREENSHOTS"]) / name), full_page=True)


def test_trainer_run_live_accuracy_evaluation_and_restart_at_ttt5(
        web: Service, page: Page, tiny_verifier: Path, prepared_data: Path, tiny_corpus: Path) -> None:
    spec = _trainer_spec(tiny_verifier, prepared_data, web.workspace / "out", tiny_corpus)
    spec["trainer"]["epochs"] = 12
    run = web.submit(spec)
    sign_in(page, web, f"#/runs/{run['id']}")
    # an ETA needs a step rate, so at least two metric reads: wait for it rather than race the first one
    live = web.wait(run["id"], lambda r: r["status"] == "running" and "acc_2" in r["latest"]
                    and r["eta_seconds"] is not None, timeout=180, what="live metrics with an ETA")
    assert {"loss_0", "loss_1", "loss_2", "cond_acc_2", "lr", "grad_norm", "tokens_per_s"} <= set(live["latest"])
    assert "loss_3" not in live["latest"], "a TTT=3 draft reports exactly three steps"
    assert live["eta_seconds"] is not None and live["progress"] is not None
    wait_for_points(page, "acc", 3, timeout=180_000)
    hold_gpu(web, web.run(run["id"]), 87)
    assert "acc_2" in legend(page, "acc") and "acc_3" not in legend(page, "acc")
    wait_for_points(page, "throughput", 0)
    # the simulated acceptance of the newest validation, position by position past the trained depth
    wait_for_points(page, "sim", 15, timeout=180_000)
    assert "sim_acc · attempt 1" in legend(page, "sim")
    expect(page.locator("#sim-tau")).to_have_text(re.compile(r"^\d+(\.\d+)?$"))

    first = web.wait_status(run["id"], "succeeded", "failed", timeout=300)
    assert first["status"] == "succeeded", (first["message"], web.logs(run["id"], tail=60))
    release_gpus(web)
    losses = web.series(run["id"], "loss", attempt=1)
    assert losses[-1]["value"] < losses[0]["value"], "training lowers the loss"
    report = web.client.get(f"/v1/runs/{run['id']}/evaluation").json()
    assert report["attempt"] == 1 and report["ttt_steps"] == 3
    taus = [row["mean_accepted"] for row in report["by_depth"]]
    assert len(taus) == 4 and 1.0 <= taus[0] <= 2.0 and taus == sorted(taus)
    expect(page.locator("h1 .badge")).to_have_text("succeeded", timeout=30_000)
    wait_for_points(page, "acceptance", 3)
    wait_for_points(page, "tau", 3)
    expect(page.locator("#advice .advice")).to_have_count(2)
    expect(page.locator("#advice")).to_contain_text("PCIe")
    expect(page.locator("#advice")).to_contain_text("NVLink")
    expect(page.locator("#advice .depth").first).to_have_text(re.compile(r"^\d"))

    page.click("#restart-form summary")
    assert page.locator("#restart-form input").first.get_attribute("id") == "restart-ttt", "TTT depth comes first"
    page.fill("#restart-ttt", "5")
    page.select_option("#restart-start-from", "fresh")
    with page.expect_response(lambda r: "/restart?" in r.url and "dry_run" in r.url) as dry_run:
        page.click("#restart-preview")
    assert dry_run.value.request.post_data_json == {"overrides": {"ttt_steps": 5}, "clean": True, "init_from_last": False}
    dry = dry_run.value.json()
    measured = first["attempts"][0]["seconds_per_step"]
    assert dry["predicted_duration_seconds"] > first["attempts"][0]["total_steps"] * measured, \
        "two more TTT steps per step cost more than the measured pace"
    # the basis: attempt 1's measured pace at TTT=3, or the trainer's own split of a step (fixed + per TTT iteration)
    measured_basis = re.compile(r"TTT=3|timed by the trainer")
    assert measured_basis.search(dry["basis"]), dry["basis"]
    expect(page.locator("#predicted-duration")).to_have_text(re.compile(r"^\d+(s|m \d+s|h \d+m)$"))
    expect(page.locator("#restart-prediction")).to_contain_text("trainer.ttt_steps: 3 → 5")
    expect(page.locator("#restart-prediction")).to_contain_text(measured_basis)
    assert web.run(run["id"])["attempt"] == 1
    page.click("#restart-confirm")

    expect(page.locator("#attempt")).to_have_text("2", timeout=30_000)
    assert web.run(run["id"])["attempts"][1]["spec"]["trainer"]["ttt_steps"] == 5
    expect(page.locator("#attempts tr[data-attempt='2']")).to_contain_text("trainer.ttt_steps: 3 → 5")
    page.wait_for_function("() => document.querySelector('#chart-acc .u-legend')?.textContent.includes('acc_4 · attempt 2')",
                           timeout=180_000)
    assert "acc_2 · attempt 1" in legend(page, "acc"), "attempt 1's lines stay: attempt 2 is a new segment"
    # one compact legend row per attempt for the 3 + 5 acc_k lines, not eight entries
    assert page.locator("#chart-acc .compact-legend > div").count() == 2
    assert "acc_0 … acc_4 · attempt 2" in legend(page, "acc")
    # the loss chart is step 0's loss, the same quantity at TTT=3 and TTT=5 (the summed `loss` is not)
    expect(page.locator("#chart-loss .u-title")).to_contain_text("loss_0")
    page.wait_for_function("() => document.querySelector('#chart-loss .u-legend')?.textContent.includes('loss_0 · attempt 2')",
                           timeout=60_000)
    assert "loss_0 · attempt 1" in legend(page, "loss") and "loss · attempt" not in legend(page, "loss")
    # attempt 2 started over (--clean) at step 1: it is drawn from there, over attempt 1, step for step
    markers = json.loads(page.get_attribute("#chart-loss", "data-markers") or "[]")
    first_of_second = min(p["step"] for p in web.series(run["id"], "loss_0") if p["attempt"] == 2)
    assert [m["label"] for m in markers] == ["attempt 2 · TTT 5"] and markers[0]["x"] == first_of_second <= 1
    hold_gpu(web, web.run(run["id"]), 91)
    web.wait(run["id"], lambda r: (r["progress"] or 0) >= 0.5, what="attempt 2 half done")
    wait_for_points(page, "gpu-util", 4)
    screenshot(page, "run-page.png")

    done = web.wait_status(run["id"], "succeeded", "failed", timeout=300)
    assert done["status"] == "succeeded", (done["message"], web.logs(run["id"], tail=60))
    release_gpus(web)
    assert done["attempts"][1]["prediction_error"] is not None
    assert {r["ttt_steps"] for r in web.client.get(f"/v1/runs/{run['id']}/evaluation").json()["by_attempt"]} == {3, 5}
    for link in ("pcie", "nvlink"):
        advice = web.client.get(f"/v1/runs/{run['id']}/advice", params={"interconnect": link, "tp": 8})
        assert advice.status_code == 200, advice.text
        body = advice.json()
        assert body["attempt"] == 2 and body["recommended_depth"] in range(0, 5)
        assert body["retrain"]["trained_ttt"] == 5
    page.wait_for_function("() => document.querySelector('#chart-acceptance .u-legend')?.textContent.includes('attempt 2')",
                           timeout=30_000)
    # whether to retrain is the run's one verdict (its proposal), said beside the per-interconnect advice
    expect(page.locator("#advice .advice").first).to_contain_text("Serve at depth")
    action = web.client.get(f"/v1/runs/{run['id']}/proposal").json()["action"]
    said = {"restart": "Retrain: restart at TTT=", "keep_going": "Retrain: keep going",
            "cannot_tell": "Retrain: cannot tell yet", "unavailable": "Retrain: no proposal yet"}[action]
    expect(page.locator("#evaluation-verdict")).to_contain_text(said)
    expect(page.locator("#evaluation-card")).not_to_contain_text("pays off")
    assert page.errors == []  # type: ignore[attr-defined]

    toy = web.submit(toy_spec(steps=3000, sleep=0.1, nproc=1, name="toy-baseline"))
    web.wait(toy["id"], lambda r: "loss" in r["latest"] and r["eta_seconds"] is not None, what="toy metrics")
    page.goto(f"{web.url}/#/")
    rows = page.locator("#runs tbody tr[data-run-id]")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("toy-baseline")
    expect(rows.nth(0).locator("td").nth(5)).to_have_text(re.compile(r"\d+(s|m)"))  # its ETA
    expect(rows.nth(1).locator("td").nth(6)).to_have_text("5")  # the trainer run's TTT depth now
    page.set_viewport_size({"width": 1280, "height": 260})
    screenshot(page, "runs-list.png")
    web.client.post(f"/v1/runs/{toy['id']}/cancel")
