"""Settings from LONGRUN_* environment variables."""

import ipaddress
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# threads that may each hold a database connection at once (server/db.py POOL_SIZE): the API's thread pool
# (sync routes and run_in_threadpool; set as the server starts, server/api/app.py) and the worker's
# (worker/supervisor.py max_parallel)
API_THREADS = 40
WORKER_THREADS = 16


def is_loopback(host: str) -> bool:
    """Whether listening on `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LONGRUN_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".longrun")
    database_url: str | None = None
    api_token: str | None = None
    bind_host: str = "127.0.0.1"
    port: int = 8080
    # Host headers the API answers to, comma-separated ("*": any); by default the loopback names and bind_host
    allowed_hosts: str | None = None
    max_body_bytes: int = 1024 * 1024
    # the proxies in front of the API whose X-Forwarded-For and X-Forwarded-Proto are believed, comma-separated
    # addresses or networks ("*": any), as uvicorn's --forwarded-allow-ips takes them; none by default, so that a
    # client's own header cannot pass it off as another address (the token throttle counts failures per address)
    forwarded_allow_ips: str = ""
    # worker behaviour
    poll_interval: float = 1.0
    lease_seconds: float = 30.0
    cancel_grace: float = 10.0
    unreachable_deadline: float = 900.0
    gpu_wait_deadline: float = 1800.0
    gpu_sample_interval: float = 5.0
    # the stall rule (server/lifecycle.py stall_seen): no step for stall_factor x the attempt's own step time,
    # and at least stall_floor seconds
    stall_factor: float = 10.0
    stall_floor: float = 600.0
    ssh_connect_timeout: float = 10.0
    ssh_command_timeout: float = 120.0
    # webhooks on run state changes (worker/notifier.py); off without a URL
    webhook_url: str | None = None
    webhook_secret: str | None = None
    webhook_format: Literal["json", "slack"] = "json"
    webhook_timeout: float = 10.0  # seconds, one deadline for each delivery in all (connect, send, every read)
    webhook_tries: int = 6

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.home / 'longrun.db'}"

    def host_allow_list(self, bind_host: str | None = None) -> list[str]:
        """The Host header names the API answers to when it listens on `bind_host`."""
        if self.allowed_hosts:
            return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
        return [*LOOPBACK_NAMES, bind_host or self.bind_host]

    @property
    def local_workspace(self) -> Path:
        return self.home / "workspace"
