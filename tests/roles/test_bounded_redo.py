"""Bounded redo (``Recovery(snapshot_every_steps=K)``), with real processes over real
sockets: the root runs each training window as segments of K steps and keeps a snapshot
after each, so that a loss redoes at most K steps; the run ends bitwise where an
uninterrupted run ends, and where the same run without K ends."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import anyio
import pytest
import torch

import lampdist
from lampdist import control
from lampdist._epoch import segments
from lampdist.control import Command, CommandKind

from ._jobs import NEVER, Job, assert_same_run, uninterrupted

WINDOW = ["--window", "4", "--epochs", "3"]
"""Windows of 4 steps of 3 batches (the default accumulation) on every rank."""


def _assert_same_sums(got: Path, want: Path) -> None:
    """The learning curve's metrics and each pass's gradient norms, bitwise (as JSON)."""
    for name in ("metrics.json", "grad_norms.jsonl"):
        assert (got / name).read_text() == (want / name).read_text(), name


@pytest.mark.slow  # processes started, killed and started again: run one at a time
@pytest.mark.parametrize(
    "args",
    [
        ["--step-on", "root"],
        ["--step-on", "sharded", "--optimizer", "adamw", "--shuffle"],
    ],
    ids=["root", "sharded"],
)
def test_snapshots_within_passes_change_nothing(tmp_path: Path, args: list[str]) -> None:
    """The same run with snapshots after every step (K=1: a segment a step, the pass's
    tallies carried across them) and without recovery: the same weights on every rank, the
    same learning curve, metrics and gradient norms, bitwise."""
    args = [*args, *WINDOW, "--metrics", "--grad-norm"]
    uninterrupted(tmp_path / "want", args)
    uninterrupted(tmp_path / "got", [*args, "--recovery", "60", "--snapshot-every", "1"])
    assert_same_run(tmp_path / "got", tmp_path / "want")
    _assert_same_sums(tmp_path / "got", tmp_path / "want")


@pytest.mark.slow  # processes started, killed and started again: run one at a time
@pytest.mark.parametrize(
    ("args", "every"),
    [
        (["--step-on", "every_rank", "--optimizer", "adamw", "--window", "4"], "1"),
        (["--step-on", "root", "--window", "6"], "2"),
    ],
    ids=["every_rank-K1", "root-K2"],
)
def test_a_follower_killed_within_a_pass_redoes_only_the_steps_since_its_snapshot(
    tmp_path: Path, args: list[str], every: str
) -> None:
    """Rank 2 is SIGKILLed late in the second window (as its loader draws the window's last
    batch, the kernel at most a step or two behind); the replacement joins, every rank goes back to
    the snapshot of the last K-step boundary, the pass's running sums included, and the
    redo starts there, not at the window's start (the Recovered event's ``from_step`` and
    the root's log say where). The run ends bitwise as the uninterrupted run without K."""
    args = [*args, "--epochs", "2", "--metrics", "--grad-norm"]
    window = int(args[args.index("--window") + 1])
    last = str(2 * window * 3)  # the second window's last batch (3 batches a step)
    uninterrupted(tmp_path / "want", args)
    job = Job(
        tmp_path / "got",
        [*args, "--recovery", "60", "--snapshot-every", every],
        {0: ["--die-after", NEVER], 1: ["--die-after", NEVER], 2: ["--die-after", last]},
    )
    try:
        assert job.wait_for(2, timeout=180) == -signal.SIGKILL
        job.replace(2)
        ended = job.finish()
    finally:
        job.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert_same_run(tmp_path / "got", tmp_path / "want")
    _assert_same_sums(tmp_path / "got", tmp_path / "want")
    (event,) = [json.loads(line) for line in (tmp_path / "got" / "recovered.jsonl").open()]
    assert event["ranks"] == [2] and event["phase"] == "train", event
    assert event["epoch"] == 1 and event["from_step"] > 0, event
    assert event["from_step"] % int(every) == 0 and event["from_step"] < window, event
    assert f"is redone from step {event['from_step']}" in ended[0][1], ended[0][1]


def test_segments_cover_the_window_once() -> None:
    assert segments(4, 1) == [(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1)]
    assert segments(5, 2) == [(0, 2, 2), (2, 4, 2), (4, 5, 2)]
    assert segments(3, 20) == [(0, 3, 20)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "5"])
def test_a_bad_snapshot_every_steps_is_refused(bad: object) -> None:
    with pytest.raises(lampdist.ConfigError, match=r"Recovery.snapshot_every_steps must be an int"):
        lampdist.Recovery(snapshot_every_steps=bad)  # type: ignore[arg-type]


def test_snapshot_every_steps_needs_windows() -> None:
    from tests.roles.reference import make_model, mse

    async def main() -> None:
        model = lampdist.SupervisedModel(make_model(seed=0), mse)
        root, _ = control.local_channels(2)
        async with root:
            await lampdist.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=root,
                data=lampdist.ModelWithData(model=model, train_batches=list),
                optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1),
                loop=lampdist.LoopOptions(
                    max_epochs=1, recovery=lampdist.Recovery(snapshot_every_steps=5)
                ),
            )

    with pytest.raises(lampdist.ConfigError, match="snapshot_every_steps=5 needs StepOptions"):
        anyio.run(main)


def test_a_train_segment_travels_and_is_checked() -> None:
    command = Command(kind=CommandKind.TRAIN, epoch=1, pass_index=2, segment=(2, 4, 2))
    assert Command.from_json(command.to_json()) == command
    for kind, segment in [
        (CommandKind.VALID, (0, 1, 1)),
        (CommandKind.TRAIN, (2, 2, 1)),
        (CommandKind.TRAIN, (0, 1, 0)),
        (CommandKind.TRAIN, (-1, 1, 1)),
    ]:
        with pytest.raises(lampdist.ConfigError, match="segment"):
            Command(kind=kind, epoch=0, pass_index=0, segment=segment)
