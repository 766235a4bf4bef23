"""The Python in the README and the guide pages parses, and every lampdist name and keyword
it uses exists."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT_DIR = Path(__file__).resolve().parents[2]
PAGES = [
    "README.md",
    "docs/tutorial.md",
    "docs/concepts.md",
    "docs/howto-bring-your-model.md",
    "docs/howto-multinode.md",
    "docs/howto-tls-secrets.md",
    "docs/howto-checkpoint-resume.md",
    "docs/howto-object-store.md",
    "docs/checkpoints.md",
    "docs/howto-uneven-data.md",
    "docs/howto-metrics.md",
    "docs/howto-service.md",
    "docs/howto-trackers.md",
    "docs/comparison.md",
    "docs/howto-ray.md",  # its blocks are ```py (not run: they need a Ray instance)
    "docs/howto-ray-train.md",
]
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
NOT_RUN = re.compile(r"^( *)```py\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
"""The ```py blocks of a page that cannot run here (the Ray pages): checked, not run."""
MODULES = {"lampdist": "lampdist", "checkpoint": "lampdist.checkpoint"}
MODULES |= {"schedules": "lampdist.schedules", "control": "lampdist.control"}
MODULES |= {"trackers": "lampdist.trackers"}
importlib.import_module("lampdist.ray")  # imports no Ray; lampdist.ray.NAME then resolves


def blocks(page: str, pattern: re.Pattern[str] = BLOCK) -> list[str]:
    """The page's ```python blocks (or ``pattern``'s), unindented."""
    text = (ROOT_DIR / page).read_text()
    return [
        "\n".join(line.removeprefix(indent) for line in body.splitlines())
        for indent, body in pattern.findall(text)
    ]


def resolve(node: ast.expr) -> Any:
    """The lampdist object a dotted name like ``lampdist.launch.from_env`` names, or None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in MODULES:
        return None
    obj: Any = importlib.import_module(MODULES[node.id])
    for part in parts:
        assert hasattr(obj, part), f"{node.id}.{'.'.join(parts)} does not exist"
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("page", PAGES)
def test_code_is_true_to_the_api(page: str) -> None:
    found = blocks(page) + (blocks(page, NOT_RUN) if "howto-ray" in page else [])
    assert found or "howto-ray" not in page, f"{page} has no Python blocks"
    for code in found:
        tree = compile(code, page, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                resolve(node)
            if isinstance(node, ast.Call) and callable(target := resolve(node.func)):
                parameters = inspect.signature(target).parameters
                if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                    continue
                for keyword in node.keywords:
                    assert keyword.arg is None or keyword.arg in parameters, (
                        f"{page}: {ast.unparse(node.func)} takes no {keyword.arg}="
                    )


def test_the_pages_have_code() -> None:
    assert sum(len(blocks(page)) for page in PAGES) >= 14  # indented blocks included


def test_the_check_catches_a_wrong_keyword() -> None:
    tree = ast.parse("lampdist.train(launch=None, epochs=3)")
    call = tree.body[0].value  # type: ignore[attr-defined]
    parameters = inspect.signature(resolve(call.func)).parameters
    assert "launch" in parameters and "epochs" not in parameters
    with pytest.raises(AssertionError, match="does not exist"):
        resolve(ast.parse("lampdist.launch.from_environment").body[0].value)  # type: ignore[attr-defined]
