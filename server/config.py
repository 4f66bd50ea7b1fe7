"""Settings from LONGRUN_* environment variables."""

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LONGRUN_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".longrun")
    database_url: str | None = None
    api_token: str | None = None
    bind_host: str = "127.0.0.1"
    port: int = 8080
    # worker behaviour
    poll_interval: float = 1.0
    lease_seconds: float = 30.0
    cancel_grace: float = 10.0
    unreachable_deadline: float = 900.0
    gpu_wait_deadline: float = 1800.0
    gpu_sample_interval: float = 5.0
    ssh_connect_timeout: float = 10.0
    ssh_command_timeout: float = 120.0
    # webhooks on run state changes (worker/notifier.py); off without a URL
    webhook_url: str | None = None
    webhook_secret: str | None = None
    webhook_format: Literal["json", "slack"] = "json"
    webhook_timeout: float = 10.0
    webhook_tries: int = 6

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.home / 'longrun.db'}"

    @property
    def local_workspace(self) -> Path:
        return self.home / "workspace"
