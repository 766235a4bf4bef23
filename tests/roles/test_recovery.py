"""In-job recovery of a lost follower (``LoopOptions(recovery=Recovery(...))``), with real
processes over real sockets: a follower killed in the middle of a pass is replaced by the
same command started again, and the run ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import anyio
import pytest
import torch

import lampdist
from lampdist import control
from lampdist.clique import CliqueId
from lampdist.control import Command, CommandKind

from ._jobs import NEVER, Job, assert_same_run, stderr, uninterrupted


@pytest.mark.parametrize(
    ("args", "die_after"),
    [
        (["--step-on", "root"], "3"),
        (["--step-on", "every_rank", "--optimizer", "adamw", "--window", "2"], "13"),
        (["--step-on", "sharded", "--optimizer", "adamw", "--metrics", "--shuffle"], "3"),
    ],
    ids=["root", "every_rank-windows", "sharded-metrics"],
)
def test_a_killed_follower_is_replaced_and_the_run_ends_as_if_nothing_happened(
    tmp_path: Path, args: list[str], die_after: str
) -> None:
    """Rank 2 is SIGKILLed in the middle of a training pass (with windows, of the second
    window: every rank goes back to its place in its training stream); the same command
    started again joins, the survivors (rank 1) hold and go on without restarting, the pass
    in flight is redone, and every rank's final weights and the learning curve equal an
    uninterrupted run's bitwise."""
    args = [*args, "--epochs", "3"]
    uninterrupted(tmp_path / "want", args)
    job = Job(
        tmp_path / "got",
        [*args, "--recovery", "60"],
        {0: ["--die-after", NEVER], 1: ["--die-after", NEVER], 2: ["--die-after", die_after]},
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
    assert "rank 1 holds" in ended[1][1]
    assert_same_run(tmp_path / "got", tmp_path / "want")
    (event,) = [json.loads(line) for line in (tmp_path / "got" / "recovered.jsonl").open()]
    assert event["ranks"] == [2] and event["recoveries"] == 1
    assert event["phase"] in ("train", "checkpoint", "valid")
    assert 0 < event["rejoin_seconds"] <= event["seconds"] < 60


STALLS_RANK_2 = {
    0: ["--die-after", NEVER],
    1: ["--die-after", NEVER],
    2: ["--die-after", "3", "--signal", "SIGSTOP"],
}
"""Rank 2 stops itself (SIGSTOP) as it takes its third training batch."""


def _stop_and_replace(job: Job) -> tuple[subprocess.Popen[str], float]:
    """Wait until rank 2 has stopped itself (SIGSTOP), then start replacements as a
    supervisor would until one joins; the stalled process and when it stopped."""
    stalled = job.ranks[2]
    deadline = time.monotonic() + 60
    while _state(stalled.pid) != "T":
        assert time.monotonic() < deadline and stalled.poll() is None
        time.sleep(0.05)
    stopped_at = time.monotonic()
    # Until the root misses its heartbeats rank 2 is the stalled process's, and a
    # replacement is refused; a supervisor starts it again, as this loop does.
    for _ in range(20):
        replacement = job.spawn(2, job.port)
        try:
            code = replacement.wait(timeout=3)
        except subprocess.TimeoutExpired:
            break  # joined, and training
        if code == 0:
            break  # joined, trained and finished (its stderr is read below)
        refused = stderr(replacement)
        assert "has already joined" in refused, refused
    job.ranks[2] = replacement
    return stalled, stopped_at


@pytest.mark.slow
def test_a_stalled_follower_is_replaced_and_its_process_told_to_go(tmp_path: Path) -> None:
    """Rank 2 stops (SIGSTOP) in the middle of a pass and the root leaves its process alone
    (``Timeouts(end_unresponsive=False)``, as for a process on another machine): the root
    misses its heartbeats, frees rank 1 (blocked in a collective with rank 2), and takes a
    replacement in; the stalled process, continued, finds that it stalled and exits non-zero
    at once, saying so, not when its collective would time out (60 s); the run ends bitwise
    as without the stall."""
    args = ["--epochs", "3", "--heartbeat", "2", "--collective-timeout", "60"]
    uninterrupted(tmp_path / "want", args)
    job = Job(
        tmp_path / "got",
        [*args, "--recovery", "60", "--keep-unresponsive"],
        STALLS_RANK_2,
    )
    stalled: subprocess.Popen[str] | None = None
    try:
        stalled, _ = _stop_and_replace(job)
        ended = job.finish()
        assert stalled.poll() is None  # left alone while stopped
        stalled.send_signal(signal.SIGCONT)
        woke = time.monotonic()
        assert stalled.wait(timeout=60) != 0
        took = time.monotonic() - woke
        gone = stderr(stalled)
    finally:
        job.kill()
        if stalled is not None and stalled.poll() is None:
            stalled.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert "heartbeat" in ended[0][1] and "recovered rank(s) [2]" in ended[0][1], ended[0][1]
    assert "rank 2" in gone and "did not run" in gone and "given up on it" in gone, gone
    assert took < 10, f"the continued process took {took:.1f} s to exit:\n{gone}"
    assert_same_run(tmp_path / "got", tmp_path / "want")


@pytest.mark.slow
def test_a_stalled_follower_on_the_roots_machine_is_ended_and_replaced(tmp_path: Path) -> None:
    """Rank 2 stops (SIGSTOP) in the middle of a pass, on the root's machine: the root finds
    it unresponsive, ends its process (SIGKILL: a supervisor sees it fail and starts it
    again), takes the replacement in, and the run ends bitwise as without the stall."""
    args = ["--epochs", "3", "--heartbeat", "2"]
    uninterrupted(tmp_path / "want", args)
    job = Job(
        tmp_path / "got",
        [*args, "--recovery", "60"],
        STALLS_RANK_2,
    )
    stalled: subprocess.Popen[str] | None = None
    try:
        stalled, _ = _stop_and_replace(job)
        assert stalled.wait(timeout=30) == -signal.SIGKILL
        ended = job.finish()
    finally:
        job.kill()
        if stalled is not None and stalled.poll() is None:
            stalled.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert "is unresponsive: ended it with SIGKILL" in ended[0][1], ended[0][1]
    assert "recovered rank(s) [2]" in ended[0][1], ended[0][1]
    assert_same_run(tmp_path / "got", tmp_path / "want")


def _state(pid: int) -> str:
    """A process's state letter (``T``: stopped)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0]


@pytest.mark.slow
def test_a_follower_not_back_in_time_ends_the_run_naming_it(tmp_path: Path) -> None:
    """No replacement within ``rejoin_timeout``: the root ends with a JoinTimeout naming the
    rank, the phase and the time it waited, soon after the timeout; the survivor ends
    naming the root's reason."""
    job = Job(tmp_path, ["--recovery", "3", "--epochs", "3"], {2: ["--die-after", "3"]})
    try:
        assert job.wait_for(2) == -signal.SIGKILL
        lost = time.monotonic()
        ended = job.finish(timeout=60)
        took = time.monotonic() - lost
    finally:
        job.kill()
    code, error = ended[0]
    assert code != 0
    assert "JoinTimeout: rank 2, phase 'recover'" in error, error
    assert "did not rejoin within 3.0 s" in error, error
    code, error = ended[1]
    assert code != 0 and "did not rejoin within 3.0 s" in error, error
    assert took < 3 + 10, took  # the bound: an error within 10 s


@pytest.mark.slow
def test_a_replacement_that_disagrees_is_refused_and_the_root_waits_for_another(
    tmp_path: Path,
) -> None:
    """A replacement with another model fails the agreement check (MismatchError naming
    the difference) and exits; the root goes on waiting, and a right one completes the
    run bitwise."""
    args = ["--epochs", "3"]
    uninterrupted(tmp_path / "want", args)
    job = Job(
        tmp_path / "got",
        [*args, "--recovery", "60"],
        {0: ["--die-after", NEVER], 1: ["--die-after", NEVER], 2: ["--die-after", "3"]},
    )
    try:
        assert job.wait_for(2) == -signal.SIGKILL
        job.replace(2, "--width", "7")
        assert job.wait_for(2) != 0
        refused = stderr(job.ranks[2])
        assert "MismatchError" in refused and "agreement" in refused, refused
        job.replace(2)
        ended = job.finish()
    finally:
        job.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert "refused the process that joined as rank(s) [2]" in ended[0][1]
    assert_same_run(tmp_path / "got", tmp_path / "want")


@pytest.mark.slow
def test_recoveries_beyond_max_recoveries_end_the_run(tmp_path: Path) -> None:
    """Two losses with ``max_recoveries=1``: the first is recovered, the second ends the run
    with the lost rank's error, saying that recoveries are used up."""
    job = Job(
        tmp_path,
        ["--recovery", "60", "--max-recoveries", "1", "--epochs", "3"],
        {1: ["--die-after", "3"], 2: ["--die-after", "8"]},
    )
    try:
        assert job.wait_for(1) == -signal.SIGKILL
        job.replace(1)
        assert job.wait_for(2) == -signal.SIGKILL
        ended = job.finish(timeout=60)
    finally:
        job.kill()
    code, error = ended[0]
    assert code != 0
    assert "recovered rank(s) [1]" in error
    assert "PeerDisconnected: rank 2" in error, error
    assert "as many as Recovery.max_recoveries allows" in error, error


@pytest.mark.slow
def test_the_roots_loss_still_ends_the_run(tmp_path: Path) -> None:
    """Recovery is the followers': the root's own death ends every follower fast, naming
    it (a restart resumes from the checkpoint)."""
    job = Job(tmp_path, ["--recovery", "60", "--epochs", "3"], {0: ["--die-after", "3"]})
    try:
        assert job.wait_for(0) == -signal.SIGKILL
        lost = time.monotonic()
        ended = {rank: (job.wait_for(rank, 30), stderr(job.ranks[rank])) for rank in (1, 2)}
        took = time.monotonic() - lost
    finally:
        job.kill()
    for rank, (code, error) in ended.items():
        assert code != 0
        assert "rank 0" in error and "PeerDisconnected" in error, f"rank {rank}: {error}"
    assert took < 10, took


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rejoin_timeout": 0}, "Recovery.rejoin_timeout must be > 0 seconds"),
        ({"rejoin_timeout": float("nan")}, "Recovery.rejoin_timeout must be > 0 seconds"),
        ({"max_recoveries": 0}, "Recovery.max_recoveries must be an int >= 1"),
        ({"max_recoveries": 1.5}, "Recovery.max_recoveries must be an int >= 1"),
    ],
)
def test_recovery_refuses_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(lampdist.ConfigError, match=message):
        lampdist.Recovery(**kwargs)  # type: ignore[arg-type]


def test_loop_options_take_a_recovery_only() -> None:
    with pytest.raises(lampdist.ConfigError, match=r"LoopOptions\.recovery must be"):
        lampdist.LoopOptions(max_epochs=1, recovery=30)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step_on", "cliques", "message"),
    [
        ("fsdp", None, r"Recovery\.fsdp_replica=False under step_on='fsdp'"),
        ("root", "in_process", "needs one process per rank over process groups"),
    ],
)
def test_recovery_is_refused_where_a_lost_rank_cannot_be_replaced(
    step_on: str, cliques: str | None, message: str
) -> None:
    """In-process followers have no process to replace; under fsdp without its replica and
    without a checkpoint_state a lost rank's shards are nowhere."""
    recovery = lampdist.Recovery(fsdp_replica=step_on != "fsdp")
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
                loop=lampdist.LoopOptions(max_epochs=1, recovery=recovery),
                step=lampdist.StepOptions(step_on=step_on),  # type: ignore[arg-type]
                cliques=(
                    lampdist.clique.in_process(["cpu", "cpu"]) if cliques == "in_process" else None
                ),
            )

    with pytest.raises(lampdist.ConfigError, match=message):
        anyio.run(main)


def test_hold_and_rejoin_carry_what_they_need_and_nothing_else() -> None:
    clique_id = CliqueId.new("127.0.0.1", 1234, nranks=3)
    hold = Command(kind=CommandKind.HOLD, epoch=1, pass_index=2, error="rank 2 lost", timeout=5)
    rejoin = Command(kind=CommandKind.REJOIN, epoch=1, pass_index=2, clique_id=clique_id)
    for command in (hold, rejoin):
        assert Command.from_json(command.to_json()) == command
    assert hold.kind.phase == "recover" and rejoin.kind.phase == "recover"
    for bad, message in [
        ({"kind": CommandKind.REJOIN}, "REJOIN command, and only it, carries a clique_id"),
        (
            {"kind": CommandKind.TRAIN, "clique_id": clique_id},
            "REJOIN command, and only it, carries a clique_id",
        ),
        ({"kind": CommandKind.TRAIN, "timeout": 1.0}, "only a HOLD command carries a timeout"),
        ({"kind": CommandKind.HOLD, "timeout": 0.0}, "Command.timeout must be > 0"),
        ({"kind": CommandKind.VALID, "error": "x"}, "only a STOP or HOLD command carries"),
    ]:
        with pytest.raises(lampdist.ConfigError, match=message):
            Command(epoch=0, pass_index=0, **bad)  # type: ignore[arg-type]


# -- a rank alone re-forms its clique (on a GPU too) -----------------------------------------


def _reforming(device: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A root alone over process groups trains two passes, uninterrupted; then again, but
    the second pass is abandoned half-way as if a rank were lost, twice, and each time the
    root recovers: its clique's next generation, its state put back from the same
    snapshot, the pass redone. Both runs' final weights."""
    from lampdist._roles._rank import RunOptions, open_rank
    from lampdist._roles._root import _Root
    from lampdist.clique import ProcessGroups

    from .reference import make_model, make_shards, mse

    train = [(x.to(device), y.to(device)) for x, y in make_shards([[5, 7, 3, 9]], seed=1)[0]]

    async def run(losses: int) -> dict[str, torch.Tensor]:
        module = make_model(seed=0).to(device)
        model = lampdist.SupervisedModel(module, mse)
        data = lampdist.ModelWithData(model=model, train_batches=lambda: train)
        options = RunOptions(
            lambda p: torch.optim.AdamW(p, lr=0.05),
            lampdist.StepOptions(),
            lampdist.Timeouts(),
            ProcessGroups(),
        )
        loop = lampdist.LoopOptions(max_epochs=2, recovery=lampdist.Recovery(rejoin_timeout=10))
        async with (
            control.tcp_root("127.0.0.1", 0, nranks=1, secret="s") as channel,
            open_rank(0, 1, torch.device(device), data, options) as context,
        ):
            root = _Root(context=context, control=channel, loop=loop, resume=None, lr_state=0)
            await root.generations.open(10)
            await context.agree_and_sync(root._runner())
            await root.generations.take_snapshot()
            await root._train_epoch(1.0)
            first = root._runner().clique
            for _ in range(losses):  # damage, then the loss of a (phantom) rank 1
                await root._runner().train_pass(
                    lambda: train[:2], epoch=1, pass_index=1, lr_factor=1.0
                )
                lost = lampdist.PeerDisconnected("gone", rank=1, phase="train")
                await root.generations.recover({1: lost}, lost)
                assert root._runner().clique is not first  # the next generation
            await root._train_epoch(1.0)
            await root.generations.close(None)
        return {name: t.detach().cpu().clone() for name, t in module.state_dict().items()}

    async def both() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return await run(0), await run(2)

    return anyio.run(both)


def test_a_rank_alone_reforms_its_clique_and_goes_back_to_its_snapshot() -> None:
    want, got = _reforming("cpu")
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_rank_alone_reforms_its_nccl_clique_and_goes_back_to_its_snapshot() -> None:
    want, got = _reforming("cuda:0")
    for name in want:
        assert torch.equal(got[name], want[name]), name
