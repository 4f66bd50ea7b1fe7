"""Which package may import which (docs/architecture.md): checked on every module, in a fresh interpreter."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# the one module of the trainer the other packages import: the names of the series it writes (standard library only)
TRAINER_SERIES = "trainer.series"


def modules_after_importing(package: str) -> set[str]:
    """The modules in sys.modules after importing every module of `package`."""
    code = (f"import importlib, pkgutil, sys, {package}\n"
            f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def loaded_after_importing(package: str) -> set[str]:
    """Top-level packages in sys.modules after importing every module of `package`."""
    return {name.split(".")[0] for name in modules_after_importing(package)}


def test_server_never_imports_the_worker_or_the_trainer() -> None:
    modules = modules_after_importing("server")
    loaded = {name.split(".")[0] for name in modules}
    assert "worker" not in loaded and "torch" not in loaded
    assert {name for name in modules if name.split(".")[0] == "trainer"} <= {"trainer", TRAINER_SERIES}


def test_the_trainers_series_names_need_only_the_standard_library() -> None:
    assert {i for i in imports_of(TRAINER_SERIES) if i.split(".")[0] not in sys.stdlib_module_names} == set()
    assert (ROOT / "trainer" / "__init__.py").read_text().strip() == ""  # importing it loads nothing else


def test_the_worker_does_not_load_the_web_framework() -> None:
    loaded = loaded_after_importing("worker")
    assert not loaded & {"fastapi", "starlette", "uvicorn", "longrun"}


def test_the_client_needs_neither_server_nor_worker() -> None:
    code = "import sys, longrun.client; print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    assert not loaded & {"server", "worker", "trainer", "fastapi", "sqlalchemy"}


PACKAGES = ("server", "worker", "trainer", "longrun")
# What the worker may use of the server: the domain without the web framework or the API's commands.
WORKER_USES = {"server.lifecycle", "server.models", "server.db", "server.layout", "server.config", "server.eta",
               "server.log_patterns", "server.series", "server.wakeup", "server.proposal", "server.spec",
               # a verifier probe's answer read into what is stored beside the all-reduce table (no web framework)
               "server.advisor.verifier", "server.advisor.tables",
               # a crash's cause read from a log without @record as `logs --rank` reads it (no web framework)
               "server.tracebacks"}
# The only modules of longrun that reach into the other packages, and what each may reach.
LONGRUN_REACHES = {
    "longrun.processes": ("server", "worker"),
    "longrun.commands.advise": ("server.advisor",),
    "longrun.tensorboard_export": ("trainer.trackers",),
    "longrun.draft_smoke": ("trainer.evaluate", "trainer.model"),  # check-draft's smoke decode
    "longrun.draft_releases": ("server.advisor.releases",),  # the release lookup the advisor's vLLM table uses
    "longrun.views": (TRAINER_SERIES,),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(module: str) -> set[str]:
    """Every module `module` imports, at the top or inside a function; `from a import b` counts as a.b when
    a.b is a module of the tree."""
    path = MODULES[module]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
            source = ".".join([*base, node.module] if node.level and node.module else base if node.level
                              else [node.module or ""])
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source)
    return found


def reaches(module: str, packages: tuple[str, ...]) -> set[str]:
    return {name for name in imports_of(module) if name.split(".")[0] in packages}


def test_the_worker_uses_only_the_servers_domain_modules_the_architecture_names() -> None:
    used = {name: reaches(name, ("server",)) - WORKER_USES for name in MODULES if name.startswith("worker")}
    assert {name: extra for name, extra in used.items() if extra} == {}


def test_longrun_reaches_the_other_packages_only_where_the_architecture_says() -> None:
    reached = {name: reaches(name, ("server", "worker", "trainer")) for name in MODULES
               if name.startswith("longrun")}
    stray = {name: {m for m in found if not m.startswith(LONGRUN_REACHES.get(name, ("-",)))}
             for name, found in reached.items()}
    assert {name: found for name, found in stray.items() if found} == {}


def test_the_server_and_the_trainer_import_no_other_package_of_the_tree() -> None:
    """The one exception: the server reads the trainer's series names (trainer/series.py)."""
    stray = {name: reaches(name, tuple(p for p in PACKAGES if p != name.split(".")[0])) - {TRAINER_SERIES}
             for name in MODULES if name.split(".")[0] in ("server", "trainer")}
    assert {name: found for name, found in stray.items() if found} == {}


def _of_the_agent(name: str) -> bool:
    # inside the zipapp the package is `hostside` (its __main__.py imports it so)
    return name.split(".")[:2] == ["worker", "hostside"] or name.split(".")[0] == "hostside"


def test_the_host_side_agent_needs_only_the_standard_library() -> None:
    """It is shipped to hosts as one zipapp and run there alone: each module of the package imports only the
    standard library and the package itself."""
    package = [name for name in MODULES if _of_the_agent(name)]
    assert len(package) > 5
    stray = {name: {i for i in imports_of(name) if i.split(".")[0] not in sys.stdlib_module_names
                    and not _of_the_agent(i)} for name in package}
    assert {name: found for name, found in stray.items() if found} == {}


def test_the_tensorboard_export_shares_the_trainers_tags_without_loading_torch() -> None:
    """The export names and numbers scalars with trainer/trackers.py, as the trainer's live tracker does; that
    module loads torch only inside the tracker that writes."""
    code = "import sys, longrun.tensorboard_export; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    assert "trainer.trackers" in loaded and not {n for n in loaded if n.split(".")[0] in ("torch", "server", "worker")}


def import_cycles() -> list[list[str]]:
    """Every strongly connected group of two or more modules of the tree (Tarjan), each sorted."""
    graph = {name: {m for m in imports_of(name) if m in MODULES and m != name} for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def test_no_module_of_the_tree_imports_itself_through_others() -> None:
    assert import_cycles() == []
