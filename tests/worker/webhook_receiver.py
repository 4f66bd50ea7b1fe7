"""A webhook receiver on 127.0.0.1 for tests: records each call; can refuse the first ones, or never answer."""

import json
import socket
import threading
import time
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


class Dripper:
    """A receiver that answers its first call one byte every `every` seconds, for ever (until closed), and
    answers later calls at once with 200; records when each call came."""

    def __init__(self, every: float = 2.0):
        self.every, self.calls = every, []  # times (time.monotonic()) of the calls
        self.answered: list[float] = []  # when each later call was answered
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn, len(self.calls)), daemon=True).start()
            self.calls.append(time.monotonic())

    def _answer(self, conn: socket.socket, index: int) -> None:
        with conn:
            conn.recv(65536)
            try:
                if index == 0:
                    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 1000:
                        if self.stop.wait(self.every):
                            return
                        conn.sendall(bytes([byte]))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                self.answered.append(time.monotonic())
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
