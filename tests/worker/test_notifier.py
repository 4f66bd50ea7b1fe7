"""Webhooks on run state changes: one signed call per change, retried with backoff, Slack's shape on request,
and a receiver that is down delays no run."""

import base64
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from server.config import Settings
from server.lifecycle import RunStatus, host_unreachable, transition
from server.models import Run
from tests.inprocess import App
from tests.service import Service, kill_leftovers, toy_spec
from tests.worker.webhook_receiver import Dripper, Receiver
from worker.notifier import WebhookNotifier, signature

S = RunStatus
SECRET = "hook-s3cret"


def wait_for(what: str, check, timeout: float = 30) -> None:  # noqa: ANN001
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def verify(call: dict, secret: str | bytes = SECRET.encode()) -> None:
    """The signatures a receiver checks: Standard Webhooks' (verified by its own library, which also refuses the
    body changed by a byte) and X-Longrun-Signature, HMAC-SHA256 of the secret over "<timestamp>.<body>"."""
    headers = {k.lower(): v for k, v in call["headers"].items()}
    assert Webhook(secret).verify(call["body"], headers) == json.loads(call["body"])
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(call["body"] + b" ", headers)  # a stray space
    with pytest.raises(WebhookVerificationError):
        Webhook(b"wrong").verify(call["body"], headers)
    assert headers["x-longrun-signature"] == signature(SECRET, headers["x-longrun-timestamp"], call["body"])
    assert headers["x-longrun-signature"] != signature("wrong", headers["x-longrun-timestamp"], call["body"])


def test_one_signed_call_per_state_change_retried_with_backoff(api: App) -> None:
    receiver = Receiver(refuse_first=2)
    notifier = WebhookNotifier(api.db, Settings(home=api.settings.home, webhook_url=receiver.url,
                                                webhook_secret=SECRET))
    try:
        done, retried, cancelled = (api.submit(name=n)["id"] for n in ("done", "retried", "cancelled"))
        api.move(done, S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
        api.move(retried, S.LAUNCHING, S.RUNNING, S.LAUNCHING, S.RUNNING, S.FAILED)
        api.move(cancelled, S.LAUNCHING, S.RUNNING, S.CANCELLING, S.CANCELLED)
        queued = notifier.run_once()
        assert [(n.run_name, n.event) for n in queued] == [
            ("done", "succeeded"), ("retried", "retrying"), ("retried", "failed"), ("cancelled", "cancelled")]

        wait_for("four deliveries", lambda: len(receiver.delivered()) == 4, timeout=20)
        assert [c["status"] for c in receiver.calls[:2]] == [500, 500], "the first two were refused, then retried"
        assert sorted((b["run_name"], b["event"]) for b in receiver.delivered()) == sorted(
            (n.run_name, n.event) for n in queued), "each change delivered exactly once"
        for call in receiver.calls:
            verify(call)
        assert receiver.calls[0]["body"] in [c["body"] for c in receiver.calls[2:]], "a retry sends the same body"
        retry = next(c for c in receiver.calls[2:] if c["body"] == receiver.calls[0]["body"])
        assert retry["headers"]["webhook-id"] == receiver.calls[0]["headers"]["webhook-id"], "and the same id"
        assert len({c["headers"]["webhook-id"] for c in receiver.calls}) == 4, "one id per notification"

        with api.db.writing() as session:
            host_unreachable(session, session.get(Run, done), "ssh: timed out", datetime.now(UTC), 900)
        assert notifier.run_once() == [], "a finished run's host going away is no news"
        running = api.submit(name="away")["id"]
        api.move(running, S.LAUNCHING, S.RUNNING)
        with api.db.writing() as session:
            run = session.get(Run, running)
            host_unreachable(session, run, "ssh: timed out", datetime.now(UTC), 900)
        assert [n.event for n in notifier.run_once()] == ["host_unreachable"]
        assert notifier.run_once() == [], "said once while the host stays away"
        wait_for("the unreachable call", lambda: len(receiver.delivered()) == 5)
        time.sleep(0.5)
        assert len(receiver.delivered()) == 5
    finally:
        notifier.close()
        receiver.close()


def test_slack_payload(api: App) -> None:
    receiver = Receiver()
    notifier = WebhookNotifier(api.db, Settings(home=api.settings.home, webhook_url=receiver.url,
                                                webhook_format="slack"))
    try:
        run = api.submit(name="nightly")["id"]
        api.move(run, S.LAUNCHING, S.RUNNING)
        with api.db.writing() as session:
            transition(session, session.get(Run, run), S.FAILED, "attempt 1 exited with code 3")
        notifier.run_once()
        wait_for("the call", lambda: receiver.delivered())
        assert receiver.delivered() == [
            {"text": f"longrun: run *nightly* (`{run}`, attempt 1) failed: attempt 1 exited with code 3"}]
        assert "x-longrun-signature" not in {k.lower() for k in receiver.calls[0]["headers"]}, "no secret, no signature"
    finally:
        notifier.close()
        receiver.close()


def test_a_whsec_secret_is_the_base64_of_the_standard_webhooks_key_and_a_tampered_body_is_refused(api: App) -> None:
    key = bytes(range(24))
    secret = "whsec_" + base64.b64encode(key).decode()
    receiver = Receiver()
    notifier = WebhookNotifier(api.db, Settings(home=api.settings.home, webhook_url=receiver.url,
                                                webhook_secret=secret))
    try:
        run = api.submit(name="signed")["id"]
        api.move(run, S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
        notifier.run_once()
        wait_for("the call", lambda: receiver.delivered())
        [call] = receiver.calls
        headers = {k.lower(): v for k, v in call["headers"].items()}
        assert Webhook(secret).verify(call["body"], headers)["event"] == "succeeded", "the receiver's own secret"
        assert Webhook(key).verify(call["body"], headers, json_parse=False) is None
        tampered = call["body"].replace(b"succeeded", b"cancelled")
        with pytest.raises(WebhookVerificationError, match="No matching signature"):
            Webhook(secret).verify(tampered, headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(secret).verify(call["body"], {**headers, "webhook-id": "msg_other"})
        assert headers["webhook-signature"].startswith("v1,") and int(headers["webhook-timestamp"]) > 0
    finally:
        notifier.close()
        receiver.close()
    for bad in ("whsec_not base64!", "whsec_"):
        with pytest.raises(ValueError, match="LONGRUN_WEBHOOK_SECRET"):
            WebhookNotifier(api.db, Settings(home=api.settings.home, webhook_url=receiver.url, webhook_secret=bad))


@pytest.mark.slow
def test_a_real_server_notifies_each_change_and_a_hung_receiver_delays_nothing(tmp_path: Path) -> None:
    receiver, hung = Receiver(), Receiver(hang=True)
    services = []
    try:
        for name, target in (("live", receiver), ("hung", hung)):
            svc = Service(tmp_path / name, webhook_url=target.url, webhook_secret=SECRET, webhook_timeout=120)
            svc.home.mkdir()
            services.append(svc.start())
        live, slow = services
        run = live.submit(toy_spec(steps=30, sleep=0.01, nproc=1, args=["--fail-at", "3"], max_retries=1))
        assert live.wait_status(run["id"], "succeeded", "failed")["status"] == "failed"
        wait_for("two calls", lambda: len(receiver.delivered()) == 2)
        assert [(b["event"], b["attempt"]) for b in receiver.delivered()] == [("retrying", 2), ("failed", 2)]
        for call in receiver.calls:
            verify(call)

        first = slow.submit(toy_spec(steps=5, sleep=0.01, nproc=1, args=["--fail-at", "2"], max_retries=1))
        assert slow.wait_status(first["id"], "succeeded", "failed")["status"] == "failed"
        second = slow.submit(toy_spec(steps=5, sleep=0.01, nproc=1))
        assert slow.wait_status(second["id"], "succeeded", "failed")["status"] == "succeeded"
        assert len(hung.calls) == 0, "both runs ended while the receiver held its first call (for 120 s)"
    finally:
        for svc in services:
            svc.stop()
            kill_leftovers(svc.workspace)
        receiver.close()
        hung.close()


def test_a_receiver_dripping_a_byte_every_2s_holds_a_delivery_no_longer_than_its_timeout(api: App) -> None:
    dripper = Dripper(every=2.0)
    notifier = WebhookNotifier(api.db, Settings(home=api.settings.home, webhook_url=dripper.url, webhook_timeout=3,
                                                webhook_tries=1))
    try:
        first, second = (api.submit(name=n)["id"] for n in ("first", "second"))
        api.move(first, S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
        api.move(second, S.LAUNCHING, S.RUNNING, S.FAILED)
        assert len(notifier.run_once()) == 2
        assert dripper.answered == [], "the worker's tick only queues: it returned before any delivery ended"
        wait_for("the second delivery", lambda: dripper.answered, timeout=30)
        # the first call is given up at its 3 s deadline (before: held for as long as the bytes dripped)
        assert dripper.answered[0] - dripper.calls[0] < 5, dripper.answered[0] - dripper.calls[0]
    finally:
        notifier.close()
        dripper.close()
