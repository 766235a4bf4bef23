"""lampdist.ray.run on a local Ray instance (in a loopback-only network namespace), three
actors over Gloo: the results come back, a lost follower is recovered and a lost root starts
the job again, each run ending bitwise where the reference run of three plain processes
(tests.roles.tcp_rank, uninterrupted) ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import lampdist
from tests.roles._jobs import assert_same_run, uninterrupted

from ._namespace import needs_loopback_namespace, run_in_loopback_namespace

ROOT_DIR = Path(__file__).resolve().parents[2]


def run_cases(out: Path, *cases: str, timeout: float = 400) -> dict[str, dict[str, Any]]:
    """``tests.ray.engine_program``'s cases, in one Ray instance; each case's report."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT_DIR / 'src'}{os.pathsep}{ROOT_DIR}"}
    done = run_in_loopback_namespace(
        ["-m", "tests.ray.engine_program", "--out", str(out), *cases], timeout=timeout, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return {case: json.loads((out / case / "report.json").read_text()) for case in cases}


@needs_loopback_namespace
def test_results_come_back_and_a_killed_follower_is_recovered_bitwise(tmp_path: Path) -> None:
    """From an async driver, every rank's LoopState comes back, equal on every rank, and the
    weights and learning curve equal three plain processes' bitwise; rank 2's process
    SIGKILLed in the middle of the first training pass is restarted by Ray, rejoins, and
    the run still ends bitwise the same; cancelling the driver releases every actor and the
    placement group; a follower lost with ``max_restarts=0`` ends the job naming it."""
    uninterrupted(tmp_path / "want", ["--epochs", "3"])
    reports = run_cases(tmp_path, "clean", "follower", "cancel", "exhausted")
    for case in ("clean", "follower"):
        assert reports[case] == {"types": ["LoopState"], "same_states": True}, case
        assert_same_run(tmp_path / case, tmp_path / "want", optimizers=False)
    (event,) = [json.loads(line) for line in (tmp_path / "follower" / "recovered.jsonl").open()]
    assert event["ranks"] == [2] and event["phase"] == "train", event
    assert sorted(path.name for path in (tmp_path / "follower").glob("pid-2-*")) == [
        "pid-2-0-0",
        "pid-2-0-1",  # a second start of rank 2, in the first attempt
    ]
    cancel = reports["cancel"]
    assert cancel["trained"] and cancel["alive"] == [], cancel
    assert cancel["free_cpus"] == cancel["total_cpus"], cancel
    assert set(cancel["groups"]) == {"REMOVED"}, cancel
    exhausted = reports["exhausted"]
    assert (exhausted["error"], exhausted["rank"], exhausted["phase"]) == (
        "RankFailed",
        2,
        "recover",
    ), exhausted
    assert "max_restarts=0" in exhausted["message"], exhausted


@pytest.mark.slow
@needs_loopback_namespace
def test_a_lost_root_restarts_the_job_and_a_stalled_follower_is_replaced(tmp_path: Path) -> None:
    """The root's process SIGKILLed in epoch 2: the attempt ends, the job starts again
    (``max_failures=1``) and resumes from the checkpoint of epoch 1, ending bitwise where
    the uninterrupted run ends; rank 2 stopped (SIGSTOP) in the middle of a pass: the root
    misses its heartbeats and ends its process, Ray restarts it, and the run ends bitwise
    the same."""
    uninterrupted(tmp_path / "want", ["--epochs", "3"])
    reports = run_cases(tmp_path, "root", "stall")
    for case in ("root", "stall"):
        assert reports[case] == {"types": ["LoopState"], "same_states": True}, case
        assert_same_run(tmp_path / case, tmp_path / "want", optimizers=False)
    starts = sorted(path.name for path in (tmp_path / "root").glob("pid-*"))
    want = [f"pid-{rank}-{attempt}-0" for attempt in (0, 1) for rank in range(3)]
    assert starts == sorted(want)  # every rank started once in each attempt
    (event,) = [json.loads(line) for line in (tmp_path / "stall" / "recovered.jsonl").open()]
    assert event["ranks"] == [2] and "PeerUnresponsive" in event["reason"], event


# -- without Ray ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nranks": 0}, "nranks must be an int >= 1, got 0"),
        ({"nranks": 2.0}, "nranks must be an int >= 1, got 2.0"),
        ({"nranks": 2, "strategy": "SCATTER"}, "strategy must be one of PACK, SPREAD"),
        ({"nranks": 2, "max_restarts": -1}, "max_restarts must be an int >= 0"),
        ({"nranks": 2, "max_failures": None}, "max_failures must be an int >= 0"),
        ({"nranks": 2, "cpus_per_rank": -1}, "cpus_per_rank must be a number >= 0"),
        ({"nranks": 2, "cpus_per_rank": 0}, "pass cpus_per_rank > 0 or gpus_per_rank > 0"),
        ({"nranks": 2, "start_timeout": 0}, "start_timeout must be > 0 seconds"),
    ],
)
def test_bad_settings_are_refused_before_ray_starts(options: dict[str, Any], message: str) -> None:
    async def main(env: lampdist.launch.LaunchEnv) -> None:
        del env

    import lampdist.ray

    with pytest.raises(lampdist.ConfigError, match=message):
        anyio.run(lambda: lampdist.ray.run(main, **options))
    with pytest.raises(lampdist.ConfigError, match="main must be an async function"):
        lampdist.ray.run_sync("main", nranks=1)  # type: ignore[arg-type]


def test_run_context_is_only_known_inside_a_rank() -> None:
    import lampdist.ray

    with pytest.raises(lampdist.ConfigError, match="only known inside the main"):
        lampdist.ray.run_context()


def test_importing_lampdist_or_lampdist_ray_does_not_import_ray() -> None:
    code = "import sys, lampdist, lampdist.ray; assert 'ray' not in sys.modules, 'ray imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
