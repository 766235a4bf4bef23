"""The package root resolves its public names on first use: the names that type checkers
read (the imports under ``TYPE_CHECKING``), those it resolves at run time and ``__all__``
are the same, each resolves to its module's object, and ``import lampdist`` alone imports
no torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import lampdist


def _type_checking_imports() -> dict[str, str]:
    """Each name imported under ``if TYPE_CHECKING:`` and the module it comes from."""
    tree = ast.parse(Path(lampdist.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    names: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name} is not re-exported as itself"
            names[alias.name] = f".{node.module}" if node.module else f".{alias.name}"
    return names


def test_the_static_and_the_lazy_names_are_all_of_all() -> None:
    assert _type_checking_imports() == lampdist._WHERE
    assert sorted(lampdist._WHERE) == lampdist.__all__


@pytest.mark.parametrize("name", lampdist.__all__)
def test_each_name_is_its_modules_object(name: str) -> None:
    where = lampdist._WHERE[name]
    module = importlib.import_module(where, "lampdist")
    expected = module if where == f".{name}" else getattr(module, name)
    assert getattr(lampdist, name) is expected
    assert vars(lampdist)[name] is expected  # kept: the next use is a plain lookup


def test_dir_lists_every_public_name_resolved_or_not() -> None:
    public = [name for name in dir(lampdist) if not name.startswith("_")]
    assert public == lampdist.__all__


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'lampdist' has no attribute 'trian'"):
        lampdist.trian  # type: ignore[attr-defined]  # noqa: B018  # the typo is the point


def test_star_import_gives_every_public_name() -> None:
    namespace: dict[str, object] = {}
    exec("from lampdist import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == lampdist.__all__


def test_import_lampdist_imports_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, lampdist; print(*sorted(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    imported = done.stdout.split()
    assert "lampdist" in imported
    assert [name for name in imported if name.split(".")[0] == "torch"] == []
