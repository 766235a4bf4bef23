"""The chaos run (``benchmarks/chaos.py``): a root and two followers over TCP, twenty faults at
seeded random moments (killed, stopped and terminated ranks, dropped connections), the lost
followers recovered in the job; the same under ``--step-on fsdp``, and ``--engine ray``
(the job through ``lampdist.ray.run``, faults on the actors' processes). No process may
hang, no committed checkpoint may be lost, and every run must end with the weights of an
uninterrupted one, bitwise."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ray._namespace import needs_loopback_namespace, run_in_loopback_namespace

ROOT = Path(__file__).resolve().parent.parent
CHAOS = ROOT / "benchmarks" / "chaos.py"
TIMEOUT = 480  # about 160 s on two cores


@pytest.mark.slow
def test_chaos_run_recovers_without_hangs_or_lost_checkpoints(tmp_path: Path) -> None:
    path = tmp_path / "chaos.json"
    command = [sys.executable, str(CHAOS), "--faults", "20", "--seed", "1", "--json", str(path)]
    result = subprocess.run(
        [*command, "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    said = f"chaos.py exited {result.returncode}:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert path.exists(), said
    report: dict[str, Any] = json.loads(path.read_text())
    assert report["faults"] == 20, said
    assert report["hangs"] == 0, said
    assert report["lost_checkpoints"] == 0, said
    assert report["bitwise_equal"] is True, said
    assert report["recoveries"] >= 1, said
    assert result.returncode == 0, said


def chaos(tmp_path: Path, *args: str, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """chaos.py's report (None when it wrote none) and what it said."""
    path = tmp_path / "chaos.json"
    command = [sys.executable, str(CHAOS), *args, "--json", str(path)]
    result = subprocess.run(
        [*command, "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    said = f"chaos.py exited {result.returncode}:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    return (json.loads(path.read_text()) if path.exists() else None), said


def test_a_chaos_run_under_fsdp_recovers_a_killed_follower_bitwise(tmp_path: Path) -> None:
    """Under ``--step-on fsdp`` a killed follower is recovered in the job from its
    neighbour's replica and a killed root restarts the job from its checkpoint: every rank's
    final shards equal the uninterrupted run's, bitwise, with no hang and no lost
    checkpoint."""
    report, said = chaos(
        tmp_path,
        *("--step-on", "fsdp", "--faults", "2", "--seed", "3", "--windows", "5"),
        *("--kinds", "follower_kill,root_kill", "--faults-per-run", "2"),
        timeout=300,
    )
    assert report is not None, said
    assert report["faults"] == 2, said
    assert (report["hangs"], report["lost_checkpoints"]) == (0, 0), said
    assert report["bitwise_equal"] is True, said
    assert report["per_kind"]["follower_kill"]["recoveries"] == 1, said
    assert report["per_kind"]["root_kill"]["restarts"] == 1, said


def test_the_ray_engine_refuses_to_run_outside_a_loopback_only_namespace(tmp_path: Path) -> None:
    """``--engine ray`` outside a loopback-only network namespace ends before Ray starts,
    saying how to run it; a process kind is refused for the Ray engine."""
    if [name for _, name in socket.if_nameindex()] == ["lo"]:
        pytest.skip("this process runs in a loopback-only namespace already")
    report, said = chaos(tmp_path, "--engine", "ray", "--faults", "1", "--seed", "1", timeout=60)
    assert report is None and "unshare -n sh -c 'ip link set lo up && python" in said, said
    report, said = chaos(
        tmp_path, "--engine", "ray", "--faults", "1", "--seed", "1", "--kinds", "conn_reset",
        timeout=60,
    )  # fmt: skip
    assert report is None and "unknown kinds ['conn_reset']" in said, said


@pytest.mark.slow
@needs_loopback_namespace
def test_a_chaos_run_on_ray_recovers_killed_and_stalled_actors_bitwise(tmp_path: Path) -> None:
    """``--engine ray`` in a loopback-only namespace: a follower actor's process killed (Ray
    starts it again, it rejoins), the root actor's killed (the job starts again from its
    checkpoint) and a follower stalled for good (the root ends it, Ray starts it again):
    every run ends bitwise where the uninterrupted one ends, nothing hangs or is lost, and
    no process is left behind."""
    path = tmp_path / "chaos.json"
    done = run_in_loopback_namespace(
        [
            str(CHAOS),
            *("--engine", "ray", "--faults", "3", "--seed", "5", "--windows", "6"),
            *("--kinds", "actor_kill,root_kill,actor_stall_never", "--faults-per-run", "3"),
            *("--json", str(path), "--workdir", str(tmp_path / "work")),
        ],
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    said = f"exited {done.returncode}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert path.exists(), said
    report = json.loads(path.read_text())
    assert report["faults"] == 3, said
    assert (report["hangs"], report["lost_checkpoints"]) == (0, 0), said
    assert report["bitwise_equal"] is True and report["leftover_processes"] == [], said
    kinds = report["per_kind"]
    assert kinds["actor_kill"]["recoveries"] == 1, said
    assert kinds["root_kill"]["restarts"] == 1, said
    assert kinds["actor_stall_never"]["recoveries"] == 1, said
    assert done.returncode == 0, said
