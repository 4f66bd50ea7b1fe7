"""A webhook receiver on 127.0.0.1 for tests: records each call; can refuse the first ones, or never answer."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, refuse_first: int = 0, hang: bool = False):
        self.calls: list[dict[str, Any]] = []  # {"status", "headers", "body" (bytes)}
        self.refuse_first, self.hang = refuse_first, hang
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.hang:
                    receiver.release.wait(120)
                status = 500 if len(receiver.calls) < receiver.refuse_first else 200
                receiver.calls.append({"status": status, "headers": dict(self.headers), "body": body})
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self) -> list[dict[str, Any]]:
        """The bodies of the calls answered 200, parsed."""
        return [json.loads(c["body"]) for c in self.calls if c["status"] == 200]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
