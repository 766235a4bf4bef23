"""Every way of running lampdist that the README and docs mention has an install path that
they name: the trio backend, the examples, the demo."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT_DIR / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
README = (ROOT_DIR / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in (ROOT_DIR / "docs").glob("*.md")}
INSTALLED_EXTRA = re.compile(r'pip install [^\n]*"?\.\[([a-z,]+)\]"?')


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0] for requirement in requirements}


def test_every_extra_the_pages_install_exists() -> None:
    for text in [README, *DOCS.values()]:
        for extras in INSTALLED_EXTRA.findall(text):
            for extra in extras.split(","):
                assert extra in EXTRAS, f"pip install .[{extra}]: no such extra"


def test_trio_has_an_extra_that_the_pages_name() -> None:
    """The pages say that lampdist runs on trio: ``pip install lampdist[trio]`` gives it."""
    assert "trio" in _requirement_names(EXTRAS["trio"])
    claims = [name for name, text in DOCS.items() if re.search(r"asyncio (and|or) trio", text)]
    assert claims
    assert "[trio]" in README


def test_the_readme_names_the_extra_of_every_example() -> None:
    for example in sorted((ROOT_DIR / "examples").glob("*.py")):
        imported = set(re.findall(r"^(?:from|import) (\w+)", example.read_text(), re.MULTILINE))
        needs = {
            extra
            for extra, requirements in EXTRAS.items()
            if extra in {"examples", "demo"} and imported & _requirement_names(requirements)
        }
        assert not imported & {"starlette", "uvicorn"} or needs, example.name
        for extra in needs:
            assert f".[{extra}]" in README, f"{example.name} needs .[{extra}]"


def test_the_extras_that_the_trackers_name_bring_their_packages() -> None:
    """A missing package's error says ``pip install "lampdist[tensorboard]"`` (or
    ``[mlflow]``): those extras exist, and the tests install them."""
    assert "tensorboard" in _requirement_names(EXTRAS["tensorboard"])
    assert "mlflow-skinny" in _requirement_names(EXTRAS["mlflow"])  # the package `mlflow`
    included = {
        extra
        for requirement in EXTRAS["test"]
        if (found := re.fullmatch(r"lampdist\[([a-z,]+)\]", requirement))
        for extra in found.group(1).split(",")
    }
    assert {"tensorboard", "mlflow"} <= included
