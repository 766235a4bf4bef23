"""In-job recovery with training sources that keep their own state (lampdist's
``RandomBatches``, a ``datasets.IterableDataset``, a ``StatefulDataLoader`` over a
``datasets.Dataset``): a follower killed in the middle of a window is replaced, every rank
goes back to its place by loading its source's state, and the run ends bitwise where an
uninterrupted run ends. The harness is :mod:`._jobs`."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ._jobs import NEVER, Job, assert_same_run, uninterrupted
from .data_sources import KINDS


@pytest.mark.parametrize(
    "kind",
    [pytest.param(k, marks=[pytest.mark.slow] if k != "random" else []) for k in KINDS],
)
def test_a_killed_follower_with_a_stateful_source_recovers_bitwise(
    tmp_path: Path, kind: str
) -> None:
    """Windows of 2 steps of 3 batches (6 a window); rank 2's loading thread, a few batches
    ahead, kills its process as it draws its 16th batch (epoch 2 or the end of epoch 1,
    after a snapshot with a place in the data); its replacement and the survivors go back by
    loading their sources' states."""
    if kind != "random":
        pytest.importorskip("datasets")
    args = ["--step-on", "every_rank", "--window", "2", "--data", kind, "--epochs", "4"]
    uninterrupted(tmp_path / "want", args)
    job = Job(
        tmp_path / "got",
        [*args, "--recovery", "60"],
        {0: ["--die-after", NEVER], 1: ["--die-after", NEVER], 2: ["--die-after", "16"]},
    )
    try:
        assert job.wait_for(2) == -signal.SIGKILL
        job.replace(2)
        ended = job.finish()
    finally:
        job.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert "recovered rank(s) [2]" in ended[0][1]
    assert_same_run(tmp_path / "got", tmp_path / "want")
