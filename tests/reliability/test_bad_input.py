"""Bad input over TCP, every rank a process: a clear error on every rank, and nothing lost.

The in-process variants are in tests/roles/test_local_failures.py; these run the same kinds
of mistakes through the rank script (exit codes of docs/reliability.md).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import attrs
import pytest

from . import _training
from ._harness import cluster, report

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

FAILED, CONFIG = 1, 2
FOLLOWERS = ["--join-timeout", "10"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@attrs.frozen(kw_only=True)
class Case:
    """``codes[r]`` are the exit codes rank r may end with, ``errors[r]`` a pattern its error
    line matches; ``checkpoint`` is the newest checkpoint's next epoch afterwards."""

    name: str
    nranks: int
    args: dict[int, list[str]]
    codes: dict[int, set[int]]
    errors: dict[int, str]
    checkpoint: int | None
    followers: list[int] | None = None
    extra: tuple[int, list[str]] | None = None  # one more follower, started after the others


MISMATCHED_MODEL = (
    r"phase 'agreement': ranks \[1\] have model parameters .* that differ from the root's "
    r"\(rank 1: parameter '0.weight': shape \(7, 3\), torch.float64"
)

CASES = [
    *[
        Case(
            name=f"{value} loss, non_finite_loss='raise'",
            nranks=2,
            args={1: ["--fault", f"{value}@train:1"]},
            codes={0: {FAILED}, 1: {FAILED}},
            errors={
                0: rf"^NonFiniteLoss: rank 0, phase 'train': epoch 1, step 1: the loss of rank 1 "
                rf"was {value} \(the summed loss of the step is {value}\)",
                1: r"^RankFailed: rank 0, phase 'stop': .*NonFiniteLoss",
            },
            checkpoint=1,
        )
        for value in ("nan", "inf")
    ],
    *[
        Case(
            name=f"{value} loss, non_finite_loss='skip'",
            nranks=2,
            args={
                0: ["--non-finite", "skip"],
                1: ["--fault", f"{value}@train:1", "--non-finite", "skip"],
            },
            codes={0: {0}, 1: {0}},
            errors={0: "^$", 1: "^$"},
            checkpoint=_training.EPOCHS,
        )
        for value in ("nan", "inf")
    ],
    Case(
        name="models that differ between ranks",
        nranks=2,
        args={1: ["--width", "7"]},
        codes={0: {CONFIG}, 1: {CONFIG}},
        errors={r: rf"^MismatchError: rank {r}, {MISMATCHED_MODEL}" for r in (0, 1)},
        checkpoint=None,
    ),
    Case(
        name="mismatched settings",
        nranks=3,
        args={2: ["--accumulate", "2"]},
        codes={0: {CONFIG}, 1: {CONFIG}, 2: {CONFIG}},
        errors={
            r: rf"^MismatchError: rank {r}, phase 'agreement': ranks \[2\] have settings that "
            r"differ from the root's "
            r"\(rank 2: accumulate_gradient_over_n_batches: 2 \(the root: 1\)\)"
            for r in range(3)
        },
        checkpoint=None,
    ),
    Case(
        name="a batch that is no (inputs, target) pair",
        nranks=2,
        args={1: ["--fault", "bad-batch@source:1"]},
        codes={0: {FAILED}, 1: {FAILED}},
        errors={
            0: r"^RankFailed: rank 1, phase 'train': BadBatch",
            1: r"^BadBatch: rank 1, phase 'train': a batch must be an \(inputs, target\) pair",
        },
        checkpoint=1,
    ),
    Case(
        name="a follower started with another nranks",
        nranks=2,
        args={1: ["--nranks", "3"]},
        codes={0: {CONFIG}, 1: {CONFIG}},
        errors={  # the follower's own MismatchError on the root too: exit 2 on every rank
            0: r"^MismatchError: rank 1, phase 'clique setup': this rank expects nranks=3",
            1: r"^MismatchError: rank 1, phase 'clique setup': this rank expects nranks=3",
        },
        checkpoint=None,
    ),
    Case(
        name="fewer followers come than nranks says",
        nranks=3,
        # long enough for rank 1's process to start and join on a busy machine (3 s was not)
        args={0: ["--join-timeout", "12"]},
        followers=[1],
        codes={0: {FAILED}, 1: {FAILED}},
        errors={
            0: r"^JoinTimeout: rank 0, phase 'join': 1 of 2 followers joined; missing ranks \[2\]",
            1: r"^RankFailed: rank 0, phase 'stop': .*JoinTimeout",
        },
        checkpoint=None,
    ),
    Case(
        name="more followers come than nranks says",
        nranks=2,
        # Slow checkpoints keep the run going until the extra rank has started and knocked;
        # a run over before it comes refuses it as "already stopped" instead.
        args={0: ["--slow-checkpoint", "2"]},
        extra=(2, ["--nranks", "3"]),
        codes={0: {0}, 1: {0}, 2: {FAILED}},
        errors={2: r"^JoinRejected: rank 2, phase 'join': .*rank 2 is out of range"},
        checkpoint=_training.EPOCHS,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_input(case: Case, tmp_path: Path) -> None:
    with cluster(tmp_path) as run:
        args = {r: case.args.get(r, []) + (FOLLOWERS if r else []) for r in range(case.nranks)}
        run.start(case.nranks, args, followers=case.followers)
        if case.extra is not None:
            rank, extra = case.extra
            run.spawn(rank, case.nranks, extra + FOLLOWERS)
        run.wait(60)
        faults = [
            run.fault_time(r) for r in run.ranks if (run.out / f"fault-rank{r}.json").exists()
        ]
        for rank, handle in sorted(run.ranks.items()):
            assert handle.ended_at is not None
            report(case.name, handle, handle.ended_at - faults[0] if faults else None)
            stderr = handle.stderr_text()
            assert handle.code in case.codes[rank], f"rank {rank}: exit {handle.code}\n{stderr}"
            assert re.search(case.errors.get(rank, ""), handle.error()), f"rank {rank}:\n{stderr}"
        out, checkpoints = run.out, run.checkpoints
    assert _training.latest_epoch(checkpoints) == case.checkpoint
    if case.codes[0] == {0}:  # the run completed: with finite losses only
        curve = json.loads((out / "state.json").read_text())["curve"]
        assert len(curve) == _training.EPOCHS
        assert all(math.isfinite(value) for point in curve for value in point)
    if case.checkpoint is not None and case.checkpoint < _training.EPOCHS:
        resumed = await _training.train_in_process(case.nranks, resume_from=checkpoints)
        _training.assert_same_weights(resumed, await _training.reference(case.nranks))
