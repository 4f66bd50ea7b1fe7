"""The README and docs/ stand on their own: every file it names is in the repository, it links nothing outside it, and
the example specs it points to are specs the server accepts."""

import re
import tomllib
from pathlib import Path

import pytest

from longrun.specs import read_spec, resolve_paths
from server.schemas import RunCreate

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_page_points_outside_the_repository():
    for page in DOCS:
        text = page.read_text()
        assert "../shared" not in text, f"{page.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target:
                continue
            assert (page.parent / target).resolve().is_relative_to(ROOT), f"{page.name} links {target}"
            assert (page.parent / target).exists(), f"{page.name} links {target}, which is not there"


def test_every_example_and_doc_the_readme_names_exists():
    named = set(re.findall(r"\b((?:examples|docs|benchmarks)/[\w./-]+\.(?:ya?ml|json|py|md))", README))
    assert "examples/eagle3-ttt3.yaml" in named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"README names files that are not in the repository: {missing}"


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "examples").iterdir()
                                        if p.suffix in (".yaml", ".yml", ".json")))
def test_example_specs_are_valid_run_specs(path):
    spec = read_spec(str(ROOT / "examples" / path))
    resolve_paths(spec, str(ROOT / "examples" / path), lambda host: "/home/u/.longrun/workspace")  # as submit does
    RunCreate.model_validate(spec)


def test_the_guide_names_every_top_level_package_that_an_install_puts_in_site_packages():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    top_level = sorted({p.split(".")[0] for p in packages})
    assert top_level == ["longrun", "migrations", "server", "trainer", "worker"], "the README's count is five"
    guide = (ROOT / "docs" / "guide.md").read_text()
    said = " ".join(guide[guide.index("What `pip install .`"):].split("\n\n")[0].split())
    assert "five top-level packages" in said
    for name in top_level:
        assert f"`{name}`" in said, f"the user guide does not say that {name} is installed as a top-level package"


def test_every_screenshot_the_docs_show_is_taken_from_the_page_by_the_browser_lane():
    """docs/screenshots/ cannot go stale: each picture a page shows is one tests/web takes of the page it drives, and
    `make test-browser` writes them there (a changed page shows in git status)."""
    shown = {name for page in DOCS for name in re.findall(r"screenshots/([\w.-]+\.png)", page.read_text())}
    taken = {name for test in (ROOT / "tests" / "web").glob("test_*.py")
             for name in re.findall(r"screenshot\(page, \"([\w.-]+\.png)\"\)", test.read_text())}
    assert shown and shown <= taken, f"pictures no browser test takes: {sorted(shown - taken)}"
    assert {p.name for p in (ROOT / "docs" / "screenshots").iterdir()} == taken, "a picture no test takes again"
    makefile = (ROOT / "Makefile").read_text()
    lane = makefile[makefile.index("\ntest-browser:"):].split("\n\n")[0]
    assert "LONGRUN_SCREENSHOTS=$(CURDIR)/docs/screenshots" in lane and "tests/web" in lane
