"""The container deployment (Dockerfile, docker-compose.yml, .dockerignore), checked without a container runtime:
the compose file read by Compose itself (`docker-compose config`, Debian's package) and as written, and the
image's Python environment built the way the Dockerfile builds it, from the files the build context would hold,
then run."""

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from server.config import is_loopback
from tests.postgres import PostgresCluster
from tests.service import ROOT, free_port

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
LONGRUN_SERVICES = ("migrate", "api", "worker")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} against `env`."""
    def one(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise ValueError(f"{name}: {arg}")
        return arg or ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, value)


def environment(service: str, env: dict[str, str]) -> dict[str, str]:
    return {k: interpolate(str(v), env) for k, v in SERVICES[service].get("environment", {}).items()}


def build_context(destination: Path) -> Path:
    """A copy of the tree without what .dockerignore keeps out of the build context, read as Docker reads it: a path
    is matched by a pattern when it or a folder above it is (`**/` at any depth), the last pattern it matches decides,
    and `!` lets it in."""
    rules = [(line.startswith("!"), line.removeprefix("!")) for line in map(str.strip, (ROOT / ".dockerignore")
             .read_text().splitlines()) if line and not line.startswith("#")]

    def matches(parts: tuple[str, ...], pattern: str) -> bool:
        if pattern.startswith("**/"):
            return any(fnmatch.fnmatchcase(part, pattern.removeprefix("**/")) for part in parts)
        return any(fnmatch.fnmatchcase("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1))

    def left_out(parts: tuple[str, ...]) -> bool:
        out = False
        for allow, pattern in rules:
            if matches(parts, pattern):
                out = not allow
        return out

    def ignored(directory: str, names: list[str]) -> set[str]:
        relative = Path(directory).relative_to(ROOT).parts
        return {name for name in names if left_out((*relative, name))}

    shutil.copytree(ROOT, destination, ignore=ignored)
    return destination


DOCKERFILE = (ROOT / "Dockerfile").read_text()
DEFAULT_EXTRAS = re.search(r"^ARG EXTRAS=(\S+)$", DOCKERFILE, re.M).group(1)


def dockerfile_pip_install(extras: str = DEFAULT_EXTRAS) -> list[str]:
    """The Dockerfile's `RUN pip install ...` of the package, as an argument list, for a build with `extras`."""
    runs = [line.removeprefix("RUN ").strip() for line in DOCKERFILE.splitlines() if line.startswith("RUN pip install")]
    assert len(runs) == 1, "one pip install makes the image's environment"
    return [a.replace("${EXTRAS}", extras) for a in shlex.split(runs[0])]


def compose_config(tmp_path: Path, dotenv: str) -> dict:
    """The compose file as Compose reads it, beside a .env holding `dotenv`."""
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose not installed: `make system-deps` installs Debian's (apt-get install "
                    "docker-compose)", pytrace=False)
    shutil.copy(ROOT / "docker-compose.yml", tmp_path / "docker-compose.yml")
    (tmp_path / ".env").write_text(dotenv)
    done = subprocess.run(["docker-compose", "config"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_postgres_is_healthy_before_one_migration_job_and_the_service_waits_for_that_job() -> None:
    assert "pg_isready" in " ".join(SERVICES["postgres"]["healthcheck"]["test"])
    migrate = SERVICES["migrate"]
    assert migrate["command"] == ["longrun", "migrate"] and migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker"):
        service = SERVICES[name]
        assert "migrate" not in service["command"]
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert service["restart"] == "unless-stopped"
    assert SERVICES["api"]["command"] == ["longrun", "serve", "--no-worker"]
    assert SERVICES["worker"]["command"] == ["longrun", "worker"]
    assert SERVICES["postgres"]["restart"] == "unless-stopped"
    assert [n for n, s in SERVICES.items() if "migrate" in s.get("command", [])] == ["migrate"]


def test_every_service_uses_the_same_database_and_it_needs_a_password_from_the_operator() -> None:
    with pytest.raises(ValueError, match="LONGRUN_DB_PASSWORD"):
        environment("api", {})
    env = {"LONGRUN_DB_PASSWORD": "pw"}
    env["LONGRUN_API_TOKEN"] = "t0ken"
    urls = {environment(name, env)["LONGRUN_DATABASE_URL"] for name in LONGRUN_SERVICES}
    assert urls == {"postgresql+psycopg://longrun:pw@postgres:5432/longrun"}
    assert "ports" not in SERVICES["postgres"], "the database is reachable from compose's network only"


def test_the_api_needs_a_token_and_is_published_on_loopback_unless_the_operator_says_otherwise() -> None:
    api = SERVICES["api"]
    # compose's own network on every platform (host networking is Linux-only)
    assert all("network_mode" not in s for s in SERVICES.values())
    with pytest.raises(ValueError, match="LONGRUN_API_TOKEN"):
        environment("api", {"LONGRUN_DB_PASSWORD": "pw"})
    # it listens on every address of its container, which the server allows only with a token
    env = {"LONGRUN_DB_PASSWORD": "pw", "LONGRUN_API_TOKEN": "t0ken"}
    inside = environment("api", env)
    assert not is_loopback(inside["LONGRUN_BIND_HOST"]) and inside["LONGRUN_API_TOKEN"] == "t0ken"
    assert [interpolate(p, env) for p in api["ports"]] == ["127.0.0.1:8080:8080"]
    assert [interpolate(p, {**env, "LONGRUN_PUBLISH": "0.0.0.0", "LONGRUN_PORT": "9000"})
            for p in api["ports"]] == ["0.0.0.0:9000:8080"]
    for name, service in SERVICES.items():
        if name != "api":
            assert "ports" not in service, name


def test_every_longrun_setting_in_dotenv_reaches_the_containers_as_compose_reads_them(tmp_path: Path) -> None:
    config = compose_config(tmp_path, "LONGRUN_DB_PASSWORD=pw\nLONGRUN_API_TOKEN=t0ken\n"
                                      "LONGRUN_WEBHOOK_URL=https://hooks.example/longrun\nLONGRUN_CANCEL_GRACE=30\n")
    for name in LONGRUN_SERVICES:
        env = config["services"][name]["environment"]
        assert env["LONGRUN_WEBHOOK_URL"] == "https://hooks.example/longrun", name
        assert env["LONGRUN_CANCEL_GRACE"] == "30" and env["LONGRUN_API_TOKEN"] == "t0ken", name
        assert env["LONGRUN_DATABASE_URL"] == "postgresql+psycopg://longrun:pw@postgres:5432/longrun", name
    assert [p["host_ip"] for p in _ports(config["services"]["api"])] == ["127.0.0.1"]


def _ports(service: dict) -> list[dict]:
    # Compose 1.x prints "ip:published:target/tcp", 2.x a mapping
    out = []
    for port in service.get("ports", []):
        if isinstance(port, str):
            ip, published, target = port.split(":")
            port = {"host_ip": ip, "published": published, "target": target}
        out.append(port)
    return out


def test_the_worker_image_has_the_trainer_with_torchs_cpu_build_and_the_api_image_has_no_torch() -> None:
    assert DEFAULT_EXTRAS == "postgres"
    assert dockerfile_pip_install()[-1] == "/src[postgres]"
    worker = SERVICES["worker"]
    assert worker["build"]["args"]["EXTRAS"] == "postgres,trainer"
    assert dockerfile_pip_install("postgres,trainer")[-1] == "/src[postgres,trainer]"
    torch_line = next(line for line in DOCKERFILE.splitlines() if "torch" in line and line.startswith("RUN"))
    assert '--index-url "${TORCH_INDEX_URL}" torch' in torch_line and "*,trainer,*" in torch_line
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu$", DOCKERFILE, re.M)
    assert SERVICES["api"].get("build") == "." and "args" not in str(SERVICES["api"].get("build"))


def test_the_build_context_holds_the_package_and_none_of_the_repositorys_bulk(tmp_path: Path) -> None:
    context = build_context(tmp_path / "context")
    assert (context / "pyproject.toml").exists() and (context / "README.md").exists()
    assert (context / "server" / "api" / "app.py").exists() and (context / "migrations" / "env.py").exists()
    # the package and what pip needs to build it, nothing else: no venv (.venv, the floors' .venv-lowest), tests or docs
    assert {p.name for p in context.iterdir()} == {"pyproject.toml", "README.md", "longrun", "server", "worker",
                                                   "migrations", "trainer"}
    assert not list(context.rglob("__pycache__")) and not list(context.rglob("*.egg-info"))


@pytest.mark.slow
def test_the_images_environment_serves_on_postgresql_without_torch(tmp_path: Path, postgres: PostgresCluster) -> None:
    argv = dockerfile_pip_install()
    assert argv[:2] == ["pip", "install"] and argv[-1] == "/src[postgres]" and not any("torch" in a or "trainer" in a for a in argv)
    env_file = {"LONGRUN_DB_PASSWORD": "pw", "LONGRUN_API_TOKEN": "t0ken"}
    assert environment("api", env_file)["LONGRUN_BIND_HOST"] == "0.0.0.0"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    context = build_context(tmp_path / "src")
    # what the Dockerfile installs (its requirement, from the build context) into the new environment, by uv, which
    # `make setup` brings: pip resolved and installed the same in 30 s of the suite's CPU, uv in a few; its cache
    # kept, as a CI machine has it from `make setup`
    install = [sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
               *[a for a in argv[2:-1] if a != "--no-cache-dir"], f"{context}[postgres]"]
    done = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    python, longrun = str(venv / "bin" / "python"), str(venv / "bin" / "longrun")
    for heavy in ("torch", "transformers", "accelerate"):
        probe = subprocess.run([python, "-c", f"import {heavy}"], capture_output=True, text=True)
        assert "ModuleNotFoundError" in probe.stderr, f"{heavy} is in the image"
    assert "--no-worker" in subprocess.run([longrun, "serve", "--help"], capture_output=True, text=True,
                                           check=True).stdout

    url = postgres.create_database(migrated=False)
    port = free_port()
    # outside the source tree, so that only what pip installed is imported
    env = {"PATH": os.environ["PATH"], "LONGRUN_HOME": str(tmp_path / "data"), "LONGRUN_DATABASE_URL": url,
           "LONGRUN_PORT": str(port)}
    try:
        migrated = subprocess.run([longrun, "migrate"], env=env, cwd=tmp_path, capture_output=True, text=True)
        assert migrated.returncode == 0 and "up to date" in migrated.stdout, migrated.stderr[-3000:]
        server = subprocess.Popen([longrun, "serve", "--no-worker"], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        worker = subprocess.Popen([longrun, "worker"], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert server.poll() is None, server.stdout.read().decode()[-3000:]
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the server did not answer"
                    time.sleep(0.2)
            hosts = httpx.get(f"http://127.0.0.1:{port}/v1/hosts").json()
            assert [h["name"] for h in hosts] == ["local"]
            time.sleep(1)
            assert worker.poll() is None, worker.stdout.read().decode()[-3000:]
        finally:
            for process in (server, worker):
                process.terminate()
                process.wait(10)
    finally:
        postgres.drop_database(url)
