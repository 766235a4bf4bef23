"""The chaos run (``benchmarks/chaos.py``): a root and two followers over TCP, twenty faults at
seeded random moments (killed, stopped and terminated ranks, dropped connections), the lost
followers recovered in the job. No process may hang, no committed checkpoint may be lost, and
every run must end with the weights of an uninterrupted one, bitwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHAOS = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos.py"
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
