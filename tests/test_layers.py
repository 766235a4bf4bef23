"""The package's layers: imports point down only, and no module imports another package's
private modules (a package's ``__init__`` is its face)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import lampdist

ROOT = Path(lampdist.__file__).parent

LAYERS = [
    {"_errors", "_version", "_defaults", "_words", "_early_signals"},
    {"_launched_rank"},
    {
        "_clique_id",
        "_wakeup",
        "_openmp",
        "_store",
        "_state",
        "_device",
        "_source",
        "_metric",
        "_monitor",
        "_preload",
        "_flops",
        "_schedule_checks",
        "_schedule_json",
        "_stateless_schedules",
        "_option_checks",
        "_step_schedules",
        "_weights_import",
    },
    {"_library_schedules", "_random_batches"},
    {"_effects", "schedules", "_model", "_fsdp_options", "_timeouts", "_state_json"},
    {"_loss_model"},
    {"control", "clique", "_checkpoint", "_loop", "_step_options", "_model_with_data"},
    {"_loop_options"},
    {"launch", "checkpoint", "_options", "trackers"},
    {"_epoch"},
    {"_roles"},
    {"cli", "ray"},
    {"__init__", "__main__"},
]
LAYER = {name: index for index, names in enumerate(LAYERS) for name in names}

ROLES_LAYERS = [
    {"_agreement", "_failures", "_root_checks"},
    {"_resume", "_stopping", "_recovery", "_fsdp_recovery"},
    {"_rank", "_commands"},
    {"_run_state"},
    {"_generations"},
    {"_root", "_follower"},
    {"_local", "_train"},
    {"_evaluate"},
    {"__init__"},
]
"""The modules of ``_roles``, each importing only from the layers below it."""
ROLES_LAYER = {name: index for index, names in enumerate(ROLES_LAYERS) for name in names}


def imports(path: Path) -> Iterator[tuple[list[str], list[str]]]:
    """(the importing module's parts, each imported module's parts) under ``lampdist``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    if parts[-1] == "__init__":
        package = parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - (node.level - 1)]
        if node.module:
            yield parts, base + node.module.split(".")
        else:  # from .. import name: each name is a module
            for alias in node.names:
                yield parts, [*base, alias.name]


def test_imports_point_down_and_stay_off_other_packages_private_modules() -> None:
    wrong = []
    for path in ROOT.rglob("*.py"):
        for parts, target in imports(path):
            top = parts[0]
            if not target or target[0] == top:
                continue
            if target[0] not in LAYER or top not in LAYER:
                wrong.append(f"{'.'.join(parts)} -> {'.'.join(target)}: layer unknown")
            elif LAYER[target[0]] >= LAYER[top] and top not in ("__init__", "__main__"):
                wrong.append(f"{'.'.join(parts)} imports {'.'.join(target)}: not below it")
            if any(part.startswith("_") for part in target[1:]):
                wrong.append(f"{'.'.join(parts)} imports {'.'.join(target)}: a private module")
    assert wrong == []


def test_the_roles_modules_import_down_only() -> None:
    wrong = []
    for path in (ROOT / "_roles").glob("*.py"):
        for parts, target in imports(path):
            if target[0] != "_roles" or len(target) < 2:
                continue
            here, there = parts[-1], target[1]
            if here not in ROLES_LAYER or there not in ROLES_LAYER:
                wrong.append(f"{here} -> {there}: layer unknown")
            elif ROLES_LAYER[there] >= ROLES_LAYER[here]:
                wrong.append(f"_roles.{here} imports _roles.{there}: not below it")
    assert wrong == []
