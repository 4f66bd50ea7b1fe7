"""Webhooks on run state changes: succeeded, failed, cancelled, retrying and host unreachable; and `proposal`
when the service's depth proposal for a run changes (server/proposal.py).

The worker's tick only reads the events table and queues what it finds; a thread of the notifier's own
posts each notification, signed with an HMAC-SHA256 of the shared secret (the Standard Webhooks scheme, and
longrun's earlier X-Longrun-Signature beside it), each within one deadline
(LONGRUN_WEBHOOK_TIMEOUT, however the receiver answers), and retries a failed post with exponential backoff, so
a receiver that is slow, down or dripping delays no run and holds the next notification no longer than that. The cursor is in memory: a
notifier starts at the newest event, and one process (the embedded worker, say) should have the URL set.
"""

import base64
import binascii
import hashlib
import heapq
import hmac
import http.client
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import func, select

from server.config import Settings
from server.db import Database
from server.lifecycle import TERMINAL, RunStatus
from server.models import Event, Run

log = logging.getLogger("longrun.notifier")

# the first retry waits this long, each later one twice the one before, up to the cap
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 300.0
# of a receiver's answer only the status counts; its body is read up to this and dropped
MAX_ANSWER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Notification:
    event: str  # succeeded | failed | cancelled | retrying | host_unreachable | proposal
    run_id: str
    run_name: str
    attempt: int
    message: str | None
    time: str
    # the webhook-id header: one per notification, the same on each retry (a receiver's idempotency key)
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """X-Longrun-Signature, as the docs have documented it from the start: `sha256=<hex>` of
    HMAC-SHA256(secret, "<timestamp>.<body>"); the timestamp is signed so a replay shows."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


# The Standard Webhooks scheme as spec/standard-webhooks.md, "Version: 1.0.0", of
# github.com/standard-webhooks/standard-webhooks defines it (section "Signature scheme" and "Webhook headers"):
# webhook-id, webhook-timestamp (unix seconds) and webhook-signature "v1,<base64 of HMAC-SHA256 over
# '{id}.{timestamp}.{body}'>", its key the base64 after "whsec_" (the secret's serialization there)
SECRET_PREFIX = "whsec_"


def signing_key(secret: str) -> bytes:
    """The Standard Webhooks HMAC key: a `whsec_<base64>` secret's decoded bytes, any other secret's UTF-8 bytes
    (a Standard Webhooks library verifies it given those bytes, or `whsec_` + their base64)."""
    if not secret.startswith(SECRET_PREFIX):
        return secret.encode()
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("LONGRUN_WEBHOOK_SECRET starts with whsec_ but what follows is not base64") from None
    if not key:
        raise ValueError("LONGRUN_WEBHOOK_SECRET is whsec_ with no key after it")
    return key


def standard_signature(key: bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    """webhook-signature: `v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return f"v1,{base64.b64encode(mac).decode()}"


def payload(note: Notification, fmt: str) -> dict[str, Any]:
    """The JSON body: longrun's own shape, or Slack's incoming-webhook shape (`text`)."""
    if fmt == "slack":
        what = note.event.replace("_", " ")
        text = f"longrun: run *{note.run_name}* (`{note.run_id}`, attempt {note.attempt}) {what}"
        return {"text": f"{text}: {note.message}" if note.message else text}
    body = asdict(note)
    del body["id"]  # it is the webhook-id header
    return body


def notification_of(event: Event, run_name: str) -> Notification | None:
    """The notification a status event means, if any: an end, or the retry rule's running -> launching."""
    if event.kind == "proposal":
        return Notification("proposal", event.run_id, run_name, event.data.get("attempt", 0),
                            event.data.get("summary"), event.time.isoformat())
    to, before = event.data.get("to"), event.data.get("from")
    if to in TERMINAL:
        kind = to
    elif to == RunStatus.LAUNCHING and before == RunStatus.RUNNING:
        kind = "retrying"
    else:
        return None
    return Notification(kind, event.run_id, run_name, event.data.get("attempt", 0), event.data.get("message"),
                        event.time.isoformat())


class WebhookNotifier:
    def __init__(self, db: Database, settings: Settings):
        if not settings.webhook_url:
            raise ValueError("WebhookNotifier needs LONGRUN_WEBHOOK_URL")
        self.db, self.settings = db, settings
        self._key = signing_key(settings.webhook_secret) if settings.webhook_secret else None
        with db.reading() as session:
            self._after = session.scalar(select(func.coalesce(func.max(Event.id), 0)))
        self._unreachable: set[str] = set()
        self._due: list[tuple[float, int, int, Notification]] = []  # (when, order, tries so far, notification)
        self._order = 0
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._deliver_forever, name="longrun-webhooks", daemon=True)
        self._thread.start()

    def run_once(self) -> list[Notification]:
        """Queue the notifications since the last call (one read of the events, one of unreachable runs)."""
        notes = []
        with self.db.reading() as session:
            rows = session.execute(select(Event, Run.name).join(Run, Run.id == Event.run_id)
                                   .where(Event.id > self._after, Event.kind.in_(("status", "proposal")))
                                   .order_by(Event.id).limit(500)).all()
            away = session.execute(select(Run.id, Run.name, Run.attempt, Run.message)
                                   .where(Run.host_reachable.is_(False))).all()
        for event, name in rows:
            self._after = event.id
            note = notification_of(event, name)
            if note:
                notes.append(note)
        for run_id, name, attempt, message in away:
            if run_id not in self._unreachable:
                notes.append(Notification("host_unreachable", run_id, name, attempt, message,
                                          time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
        self._unreachable = {row[0] for row in away}
        for note in notes:
            self._schedule(note, 0, time.monotonic())
        return notes

    def close(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=self.settings.webhook_timeout + 1)

    def _schedule(self, note: Notification, tries: int, when: float) -> None:
        with self._wake:
            self._order += 1
            heapq.heappush(self._due, (when, self._order, tries, note))
            self._wake.notify()

    def _deliver_forever(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and (not self._due or self._due[0][0] > time.monotonic()):
                    self._wake.wait(timeout=self._due[0][0] - time.monotonic() if self._due else None)
                if self._stopped:
                    return
                _, _, tries, note = heapq.heappop(self._due)
            if not self._post(note) and tries + 1 < self.settings.webhook_tries:
                backoff = min(MAX_BACKOFF_SECONDS, FIRST_BACKOFF_SECONDS * 2 ** tries)
                self._schedule(note, tries + 1, time.monotonic() + backoff)

    def _post(self, note: Notification) -> bool:
        body = json.dumps(payload(note, self.settings.webhook_format)).encode()
        # each try is stamped anew (the spec's attempt timestamp); its id stays the notification's
        stamp = str(int(time.time()))
        headers = {"Content-Type": "application/json", "X-Longrun-Event": note.event, "webhook-id": note.id,
                   "webhook-timestamp": stamp}
        if self.settings.webhook_secret and self._key:
            headers |= {"webhook-signature": standard_signature(self._key, note.id, stamp, body),
                        "X-Longrun-Timestamp": stamp,
                        "X-Longrun-Signature": signature(self.settings.webhook_secret, stamp, body)}
        try:
            status = post_within(self.settings.webhook_url, body, headers, self.settings.webhook_timeout)
        except (OSError, http.client.HTTPException) as exc:
            log.warning("webhook %s for run %s not delivered within %gs: %s", note.event, note.run_id,
                        self.settings.webhook_timeout, exc.__class__.__name__)
            return False
        if 200 <= status < 300:
            return True
        log.warning("webhook %s for run %s refused: HTTP %s", note.event, note.run_id, status)
        return False


def post_within(url: str, body: bytes, headers: dict[str, str], seconds: float) -> int:
    """POST `body` and return the answer's status, all within `seconds`: a receiver that answers a byte at a time
    is cut off at the deadline (a socket timeout alone counts each read apart). Redirects are not followed."""
    parts = urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "", parts.port, timeout=seconds)
    deadline = threading.Timer(seconds, _cut, args=(connection,))
    deadline.start()
    try:
        connection.request("POST", parts.path + (f"?{parts.query}" if parts.query else "") or "/", body, headers)
        response = connection.getresponse()
        response.read(MAX_ANSWER_BYTES)
        return response.status
    finally:
        deadline.cancel()
        connection.close()


def _cut(connection: http.client.HTTPConnection) -> None:
    """End a delivery at its deadline: a shut-down socket wakes the read that waits on it."""
    if connection.sock is not None:
        try:
            connection.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
