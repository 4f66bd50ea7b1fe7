"""Where the `longrun` command finds its server: a flag, else the environment, else the config file.

    # ~/.config/longrun/config.toml (or $LONGRUN_CONFIG; $XDG_CONFIG_HOME is honoured)
    url = "http://gpu-head:8080"
    token = "s3cret"

`longrun config set url http://gpu-head:8080` writes it (readable by its owner only)."""

import os
import stat
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from longrun.client import DEFAULT_URL

KEYS = {"url": "LONGRUN_URL", "token": "LONGRUN_API_TOKEN"}


class ConfigError(ValueError):
    """The config file cannot be read or holds a key that means nothing."""


@dataclass(frozen=True)
class Connection:
    """The server to talk to, and where each setting came from ("flag", "env", a file path, "default")."""

    url: str
    token: str | None
    url_from: str
    token_from: str | None


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env  # looked up per call: a library may rebind os.environ
    if env.get("LONGRUN_CONFIG"):
        return Path(env["LONGRUN_CONFIG"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "longrun" / "config.toml"


def read_config(path: Path) -> dict[str, str]:
    """The file's settings ({} when there is none); a token in a file others can read is warned about."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not TOML: {exc}") from None
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown setting {', '.join(unknown)} (known: {', '.join(KEYS)})")
    if "token" in values and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"longrun: warning: {path} holds a token and others can read it: chmod 600 {path}", file=sys.stderr)
    return {k: str(v) for k, v in values.items()}


def write_setting(path: Path, key: str, value: str | None) -> None:
    """Set (or with None, remove) one setting, keeping the others; the file is created owner-only."""
    if key not in KEYS:
        raise ConfigError(f"unknown setting {key!r} (known: {', '.join(KEYS)})")
    values = read_config(path)
    if value is None:
        values.pop(key, None)
    else:
        values[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    # a new file, owner-only, put in place whole: an old file's mode (0644) is not kept, nor is half a file left
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(tomli_w.dumps(dict(sorted(values.items()))))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def resolve(url: str | None = None, token: str | None = None, env: Mapping[str, str] | None = None) -> Connection:
    """Each setting from its flag, else LONGRUN_URL / LONGRUN_API_TOKEN, else the config file."""
    env = os.environ if env is None else env
    path = config_path(env)
    file_values = read_config(path)

    def pick(key: str, flag: str | None) -> tuple[str | None, str | None]:
        if flag is not None:
            return flag, "flag"
        if env.get(KEYS[key]):
            return env[KEYS[key]], "env"
        if key in file_values:
            return file_values[key], str(path)
        return None, None

    chosen_url, url_from = pick("url", url)
    chosen_token, token_from = pick("token", token)
    return Connection(chosen_url or DEFAULT_URL, chosen_token, url_from or "default", token_from)
