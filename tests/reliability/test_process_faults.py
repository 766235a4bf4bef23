"""The fault matrix over TCP: every rank a process of its own, one fault injected per run.

For each fault: every surviving rank exits within 10 s of the fault (or of the deadline the
fault has to pass first), with the exit code of docs/reliability.md and an error that names
the rank and the phase; nothing is left running; the newest committed checkpoint loads, and
resuming from it finishes the run with the weights of an uninterrupted one. The time each
rank took is printed (``pytest -s``) for the table in docs/reliability.md.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

from . import _training
from ._harness import Cluster, cluster, report

pytestmark = pytest.mark.anyio

KILLED = -signal.SIGKILL
FAILED, CONFIG = 1, 2
SIGTERMED, SIGINTED = 128 + signal.SIGTERM, 128 + signal.SIGINT
FOLLOWERS = ["--join-timeout", "10"]  # the root listens before they start
HEARTBEAT_TIMEOUT = 5.0  # the rank script's, the control channel's default


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@attrs.frozen(kw_only=True)
class Case:
    """One run: ``faulty`` injects ``args[faulty]``'s fault; ``errors[r]`` must match rank r's
    error line and ``codes[r]`` its exit code; survivors exit within ``deadline`` seconds of
    the fault; the newest checkpoint holds ``checkpoint`` (the next epoch to run)."""

    name: str
    nranks: int
    faulty: int
    args: dict[int, list[str]]
    codes: dict[int, int]
    errors: dict[int, str]
    checkpoint: int | None = 1
    deadline: float = 10.0
    faulty_deadline: float | None = None  # a rank that stalled: from the fault, when it ends
    then: Callable[[Cluster], None] | None = None  # after the fault, from the test
    resume_processes: bool = False  # also resume with the rank script (else in process)
    slow: bool = True


def stopped_by_root(phase: str, cause: str) -> str:
    return rf"^RankFailed: rank 0, phase 'stop': the root stopped in phase '{phase}': {cause}"


def second_sigint(run: Cluster) -> None:
    """A second SIGINT once the root has taken the first (two pending ones would merge)."""
    deadline = time.monotonic() + 30
    while "SIGNAL" not in run.ranks[0].stdout.read_text():
        assert time.monotonic() < deadline, "the root did not take the first signal"
        time.sleep(0.02)
    run.signal(0, signal.SIGINT)


def continue_after_the_others(run: Cluster, stopped: int) -> None:
    """SIGCONT the ``stopped`` rank once every other rank has exited."""
    run.wait(HEARTBEAT_TIMEOUT + 10, [r for r in run.ranks if r != stopped])
    run.signal(stopped, signal.SIGCONT)


CASES = [
    # -- a follower killed -------------------------------------------------------------------
    Case(
        name="follower SIGKILL in join",
        nranks=2,
        faulty=1,
        args={1: ["--fault", "kill@join"]},
        codes={0: FAILED, 1: KILLED},
        errors={0: r"^PeerDisconnected: rank 1, phase '(join|clique setup)'"},
        checkpoint=None,
    ),
    Case(
        name="follower SIGKILL in clique setup",
        nranks=3,
        faulty=1,
        args={1: ["--fault", "kill@setup"]},
        codes={0: FAILED, 1: KILLED, 2: FAILED},
        errors={
            0: r"^PeerDisconnected: rank 1, phase 'clique setup'",
            2: stopped_by_root("clique setup", r"PeerDisconnected: rank 1, phase 'clique setup'"),
        },
        checkpoint=None,
    ),
    Case(
        name="follower SIGKILL in training",
        nranks=3,
        faulty=1,
        args={1: ["--fault", "kill@train:1"]},
        codes={0: FAILED, 1: KILLED, 2: FAILED},
        errors={
            0: r"^PeerDisconnected: rank 1, phase 'train'",
            2: stopped_by_root("train", r"PeerDisconnected: rank 1, phase 'train'"),
        },
        slow=False,
    ),
    Case(
        name="follower SIGKILL in validation",
        nranks=3,
        faulty=2,
        args={2: ["--fault", "kill@valid:1"]},
        codes={0: FAILED, 1: FAILED, 2: KILLED},
        errors={
            0: r"^PeerDisconnected: rank 2, phase 'valid'",
            1: stopped_by_root("valid", r"PeerDisconnected: rank 2, phase 'valid'"),
        },
    ),
    Case(
        name="follower SIGKILL in the root's checkpoint",
        nranks=3,
        faulty=1,
        args={0: ["--slow-checkpoint", "3"], 1: ["--fault", "kill@checkpoint:1"]},
        codes={0: FAILED, 1: KILLED, 2: FAILED},
        errors={
            0: r"^PeerDisconnected: rank 1, phase 'checkpoint'",
            2: stopped_by_root("checkpoint", r"PeerDisconnected: rank 1, phase 'checkpoint'"),
        },
    ),
    # -- the root killed ---------------------------------------------------------------------
    Case(
        name="root SIGKILL in join",
        nranks=2,
        faulty=0,
        args={0: ["--fault", "kill@join"]},
        codes={0: KILLED, 1: FAILED},
        errors={1: r"rank [01], phase '(handshake|join|clique setup)': .*root"},
        checkpoint=None,
    ),
    Case(
        name="root SIGKILL in clique setup",
        nranks=3,
        faulty=0,
        args={0: ["--fault", "kill@setup"]},
        codes={0: KILLED, 1: FAILED, 2: FAILED},
        errors={r: r"^\w+: rank [0-2], phase 'clique setup'" for r in (1, 2)},
        checkpoint=None,
    ),
    Case(
        name="root SIGKILL in training",
        nranks=3,
        faulty=0,
        args={0: ["--fault", "kill@train:1"]},
        codes={0: KILLED, 1: FAILED, 2: FAILED},
        errors={r: r"^PeerDisconnected: rank 0, phase 'train'" for r in (1, 2)},
    ),
    Case(
        name="root SIGKILL in validation",
        nranks=2,
        faulty=0,
        args={0: ["--fault", "kill@valid:1"]},
        codes={0: KILLED, 1: FAILED},
        errors={1: r"^PeerDisconnected: rank 0, phase 'valid'"},
    ),
    Case(
        name="root SIGKILL while writing its checkpoint",
        nranks=2,
        faulty=0,
        args={0: ["--fault", "kill@checkpoint:1"]},
        codes={0: KILLED, 1: FAILED},
        errors={1: r"^PeerDisconnected: rank 0, phase 'wait for command'"},
    ),
    # -- exceptions --------------------------------------------------------------------------
    Case(
        name="exception in a follower's loss",
        nranks=3,
        faulty=2,
        args={2: ["--fault", "raise@train:1"]},
        codes={0: FAILED, 1: FAILED, 2: FAILED},
        errors={
            0: r"^RankFailed: rank 2, phase 'train': TrainingError: .*RuntimeError: injected",
            1: stopped_by_root("train", r"RankFailed: rank 2, phase 'train'"),
            2: r"^TrainingError: rank 2, phase 'train': epoch 1, batch 1: the model raised "
            r"RuntimeError: injected .*\(inputs float64\[\d+, 3\], target float64\[\d+, 1\]\)",
        },
    ),
    Case(
        name="exception in the root's checkpoint effect",
        nranks=2,
        faulty=0,
        args={0: ["--fault", "raise@checkpoint:1"]},
        codes={0: FAILED, 1: FAILED},
        errors={
            0: r"^CheckpointError: rank 0, phase 'checkpoint': epoch 1: .*RuntimeError",
            1: stopped_by_root("checkpoint", r"CheckpointError: rank 0, phase 'checkpoint'"),
        },
    ),
    Case(
        name="exception in a follower's batch source",
        nranks=3,
        faulty=1,
        args={1: ["--fault", "raise@source:1"]},
        codes={0: FAILED, 1: FAILED, 2: FAILED},
        errors={
            0: r"^RankFailed: rank 1, phase 'train': TrainingError: .*batch source raised",
            1: r"^TrainingError: rank 1, phase 'train': the train batch source raised",
            2: stopped_by_root("train", r"RankFailed: rank 1, phase 'train'"),
        },
    ),
    # -- stopped processes (SIGSTOP): connections open, nothing read, default timeouts ------
    Case(
        name="follower stopped (SIGSTOP), 2 ranks",
        nranks=2,
        faulty=1,
        args={1: ["--fault", "stop@train:1"]},
        codes={0: FAILED, 1: KILLED},
        errors={0: r"^PeerUnresponsive: rank 1, phase 'train': no heartbeat for"},
    ),
    Case(  # the same with a short heartbeat, in the quick suite
        name="follower stopped (SIGSTOP), 2 ranks, heartbeat_timeout 2 s",
        nranks=2,
        faulty=1,
        args={
            0: ["--heartbeat-timeout", "2"],
            1: ["--fault", "stop@train:1", "--heartbeat-timeout", "2"],
        },
        codes={0: FAILED, 1: KILLED},
        errors={0: r"^PeerUnresponsive: rank 1, phase 'train': no heartbeat for"},
        deadline=2 + 5,
        slow=False,
    ),
    Case(
        name="follower stopped (SIGSTOP), 3 ranks",
        nranks=3,
        faulty=2,
        args={2: ["--fault", "stop@train:1"]},
        codes={0: FAILED, 1: FAILED, 2: KILLED},
        errors={
            0: r"^PeerUnresponsive: rank 2, phase 'train': no heartbeat for",
            1: stopped_by_root("train", r"PeerUnresponsive: rank 2, phase 'train': no heart"),
        },
    ),
    Case(
        name="follower stopped (SIGSTOP) and left alone, then continued",
        nranks=3,
        faulty=2,
        args={
            0: ["--keep-unresponsive", "--heartbeat-timeout", "2"],
            1: ["--heartbeat-timeout", "2"],
            # On a loaded machine its collective in flight, woken, was seen waiting out the
            # collective timeout (30 s) though its peers had ended; what the case checks is
            # that it knows it stalled and says so, within a bound: a shorter timeout here.
            2: ["--fault", "stop@train:1", "--keep-unresponsive", "--heartbeat-timeout", "2"]
            + ["--collective-timeout", "6"],
        },
        codes={0: FAILED, 1: FAILED, 2: FAILED},
        errors={
            0: r"^PeerUnresponsive: rank 2, phase 'train': no heartbeat for",
            1: stopped_by_root("train", r"PeerUnresponsive: rank 2, phase 'train': no heart"),
            # awake again, it knows that it stalled, and says so at once
            2: r"^PeerUnresponsive: rank 2, phase 'train': this process did not run for",
        },
        deadline=2 + 5,
        faulty_deadline=2 + 10,
        then=lambda run: continue_after_the_others(run, 2),
        slow=False,
    ),
    Case(
        name="follower stopped (SIGSTOP) while the root writes a checkpoint",
        nranks=2,
        faulty=1,
        args={0: ["--slow-checkpoint", "8"], 1: ["--fault", "stop@checkpoint:1"]},
        codes={0: FAILED, 1: KILLED},
        errors={0: r"^PeerUnresponsive: rank 1, phase 'checkpoint': no heartbeat for"},
    ),
    Case(
        name="root stopped (SIGSTOP), then continued",
        nranks=3,
        faulty=0,
        args={0: ["--fault", "stop@train:1"]},
        codes={0: FAILED, 1: FAILED, 2: FAILED},
        errors={
            0: r"^PeerUnresponsive: rank 0, phase 'train': this process did not run for",
            1: r"^PeerUnresponsive: rank 0, phase 'train': no heartbeat for",
            2: r"^PeerUnresponsive: rank 0, phase 'train': no heartbeat for",
        },
        faulty_deadline=HEARTBEAT_TIMEOUT + 10,
        then=lambda run: continue_after_the_others(run, 0),
    ),
    # -- stalls ------------------------------------------------------------------------------
    Case(
        name="follower stops reading (event loop blocked 12 s)",
        nranks=3,
        faulty=1,
        args={1: ["--fault", "stall-loop@train:1", "--sleep", "12"]},
        codes={0: FAILED, 1: KILLED, 2: FAILED},  # the root ends an unresponsive follower
        errors={
            0: r"^PeerUnresponsive: rank 1, phase 'train': no heartbeat",
            2: stopped_by_root("train", r"PeerUnresponsive: rank 1, phase 'train': no heart"),
        },
        deadline=HEARTBEAT_TIMEOUT + 10,
        faulty_deadline=12 + 10,
    ),
    Case(
        name="follower sleeps 12 s in a step (collective_timeout 4 s)",
        nranks=3,
        faulty=1,
        args={
            0: ["--collective-timeout", "4"],
            1: ["--fault", "sleep-step@train:1", "--sleep", "12", "--collective-timeout", "4"],
            2: ["--collective-timeout", "4"],
        },
        codes={0: FAILED, 1: FAILED, 2: FAILED},
        errors={  # the root's reduce times out, or rank 2's first (the same deadline)
            0: r"^(CliqueTimeout|CollectiveFailed): rank 0, .*collective_timeout=4.0 s",
            1: stopped_by_root("train", r".*collective_timeout=4.0 s"),
            2: stopped_by_root("train", r".*collective_timeout=4.0 s"),
        },
        deadline=4 + 10,
        faulty_deadline=12 + 10,
    ),
    # -- the control channel -----------------------------------------------------------------
    Case(
        name="a follower's control connection dropped",
        nranks=3,
        faulty=1,
        args={1: ["--fault", "drop@train:1"]},
        codes={0: FAILED, 1: FAILED, 2: FAILED},
        errors={
            0: r"^PeerDisconnected: rank 1, phase 'train'",
            1: r"^PeerDisconnected: rank 0, phase 'train'",
            2: stopped_by_root("train", r"PeerDisconnected: rank 1, phase 'train'"),
        },
    ),
    Case(
        name="the root's control connections dropped",
        nranks=2,
        faulty=0,
        args={0: ["--fault", "drop@train:1"]},
        codes={0: FAILED, 1: FAILED},
        errors={
            0: r"^PeerDisconnected: rank 1, phase 'train'",
            1: r"^PeerDisconnected: rank 0, phase 'train'",
        },
    ),
    # -- the root stopped from outside -------------------------------------------------------
    Case(
        name="the root's task cancelled",
        nranks=3,
        faulty=0,
        args={0: ["--fault", "cancel@train:1"]},
        codes={0: FAILED, 1: FAILED, 2: FAILED},
        errors={
            0: r"^the rank's task was cancelled",
            **{r: stopped_by_root("train", "cancelled$") for r in (1, 2)},
        },
    ),
    Case(
        name="SIGTERM to the root: the epoch ends, a checkpoint, STOP",
        nranks=3,
        faulty=0,
        args={0: ["--fault", "sigterm@train:1"]},
        codes={0: SIGTERMED, 1: 0, 2: 0},
        errors={r: "^$" for r in range(3)},
        checkpoint=2,
        resume_processes=True,
        slow=False,
    ),
    Case(
        name="SIGINT to the root: the epoch ends, a checkpoint, STOP",
        nranks=2,
        faulty=0,
        args={0: ["--fault", "sigint@train:1"]},
        codes={0: SIGINTED, 1: 0},
        errors={r: "^$" for r in range(2)},
        checkpoint=2,
    ),
    Case(
        name="SIGTERM to the root, the epoch outlasts stop_timeout=2 s",
        nranks=2,
        faulty=0,
        args={
            0: ["--fault", "sigterm@train:1", "--stop-timeout", "2"],
            1: ["--fault", "sleep-step@train:1", "--sleep", "8"],
        },
        codes={0: SIGTERMED, 1: FAILED},
        errors={
            0: r"^LampdistTimeout: rank 0, phase 'stop': stop was requested, but phase 'train'",
            1: stopped_by_root("train", r"LampdistTimeout: rank 0, phase 'stop'"),
        },
        deadline=2 + 10,
        faulty_deadline=8 + 10,
    ),
    Case(
        name="SIGINT twice to the root: abandon at once",
        nranks=2,
        faulty=0,
        args={
            0: ["--fault", "sigint@train:1", "--stop-timeout", "60"],
            1: ["--fault", "sleep-step@train:1", "--sleep", "8"],
        },
        codes={0: SIGINTED, 1: FAILED},
        errors={
            0: r"^stopped at once by a second signal",
            1: stopped_by_root("train", "cancelled"),
        },
        faulty_deadline=8 + 10,
        then=second_sigint,
    ),
]


def wait_for_fault(run: Cluster, rank: int, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return run.fault_time(rank)
        except (OSError, ValueError):
            if time.monotonic() > deadline or run.ranks[rank].poll():
                raise AssertionError(
                    f"rank {rank} injected no fault:\n{run.ranks[rank].stderr_text()}"
                ) from None
            time.sleep(0.02)


async def check_case(case: Case, tmp_path: Path) -> None:
    with cluster(tmp_path) as run:
        run.start(
            case.nranks,
            {r: case.args.get(r, []) + (FOLLOWERS if r else []) for r in range(case.nranks)},
        )
        fault_at = wait_for_fault(run, case.faulty)
        if case.then is not None:
            case.then(run)
        run.wait(max(case.deadline, case.faulty_deadline or 0) + 20)
        for rank, handle in sorted(run.ranks.items()):
            assert handle.ended_at is not None
            took = handle.ended_at - fault_at
            report(case.name, handle, took)
            stderr = handle.stderr_text()
            assert handle.code == case.codes[rank], f"rank {rank}: exit {handle.code}\n{stderr}"
            if rank in case.errors:
                assert re.search(case.errors[rank], handle.error()), f"rank {rank}:\n{stderr}"
            if rank != case.faulty:
                assert took < case.deadline, f"rank {rank} took {took:.1f} s\n{stderr}"
            elif case.faulty_deadline is not None:
                assert took < case.faulty_deadline, f"rank {rank} took {took:.1f} s\n{stderr}"
        checkpoints = run.checkpoints
    assert _training.latest_epoch(checkpoints) == case.checkpoint
    want = await _training.reference(case.nranks)
    if case.resume_processes:
        resume_with_processes(case, tmp_path, want)
    else:
        resumed = await _training.train_in_process(case.nranks, resume_from=checkpoints)
        _training.assert_same_weights(resumed, want)


def resume_with_processes(case: Case, tmp_path: Path, want: dict[str, torch.Tensor]) -> None:
    """Start the run again with ``--resume``: it finishes, and every rank ends with the
    weights of the uninterrupted run."""
    with cluster(tmp_path) as run:
        run.start(case.nranks, {0: ["--resume"], **dict.fromkeys(range(1, case.nranks), FOLLOWERS)})
        run.wait(60)
        for rank, handle in run.ranks.items():
            assert handle.code == 0, f"rank {rank}:\n{handle.stderr_text()}"
        out = run.out
    for rank in range(case.nranks):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        _training.assert_same_weights(got, want)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES],
)
async def test_fault(case: Case, tmp_path: Path) -> None:
    await check_case(case, tmp_path)


C10D_WARNING = "[c10d]"
"""How torch's C++ side starts a warning line (each followed by C++ frames)."""


@pytest.mark.slow
def test_a_finished_run_leaves_no_store_warning_in_any_log(tmp_path: Path) -> None:
    """Three ranks finish a run: every rank exits 0, and no rank's stderr holds a warning of
    the clique's store (the root waits for its followers' goodbyes before its store closes,
    so no follower's watcher asks a closed store)."""
    with cluster(tmp_path) as run:
        run.start(3, dict.fromkeys(range(1, 3), FOLLOWERS))
        run.wait(60)
        for rank, handle in run.ranks.items():
            stderr = handle.stderr_text()
            assert handle.code == 0, f"rank {rank}:\n{stderr}"
            assert C10D_WARNING not in stderr, f"rank {rank}:\n{stderr}"


def test_a_dead_roots_store_costs_a_follower_one_warning_at_most(tmp_path: Path) -> None:
    """The root is killed in training: each follower ends naming it, its stderr holding at
    most one failed store call (one call in flight as the root died: torch writes two warning
    lines for it at most), not one per poll and abort."""
    with cluster(tmp_path) as run:
        run.start(3, {0: ["--fault", "kill@train:1"], **dict.fromkeys(range(1, 3), FOLLOWERS)})
        run.wait(40)
        for rank in (1, 2):
            stderr = run.ranks[rank].stderr_text()
            assert run.ranks[rank].code == FAILED, f"rank {rank}:\n{stderr}"
            assert stderr.count(C10D_WARNING) <= 2, f"rank {rank}:\n{stderr}"
