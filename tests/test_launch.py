"""lampdist.launch reads torchrun's and SLURM's variables; lampdist.train runs the right role."""

from __future__ import annotations

import os
import signal
import socket
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path

import anyio
import attrs
import pytest
import torch
import trustme
from torch._C._distributed_c10d import TCPStore

import lampdist
from lampdist._roles import Interrupted, run_until_signal
from lampdist._roles._train import _run_until_signal
from lampdist.launch import LaunchEnv, PortExchange, first_slurm_host, from_env

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "node-a",
    "MASTER_PORT": "29500",
    "LAMPDIST_SECRET": "s3cret",
}
SLURM = {
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "MASTER_PORT": "29500",
    "LAMPDIST_SECRET": "s3cret",
}


def test_torchrun_variables() -> None:
    env = from_env(TORCHRUN)
    assert (env.rank, env.nranks, env.local_rank) == (1, 4, 1)
    assert (env.host, env.port, env.secret) == ("node-a", 29501, "s3cret")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert env.device.type == expected
    assert not env.is_root


AGENT_STORE = {
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "run-7",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


@pytest.mark.parametrize("rank", ["0", "1"])
def test_torchrun_agent_store_carries_the_control_port(rank: str) -> None:
    env = from_env({**TORCHRUN, **AGENT_STORE, "RANK": rank, "LOCAL_RANK": rank})
    assert env.port == 0  # the root picks a free port; the followers read it from the store
    assert env.port_exchange == PortExchange(
        host="node-a", port=29500, key="lampdist/control-port/run-7/2"
    )


def test_lampdist_port_wins_over_the_agent_store() -> None:
    env = from_env({**TORCHRUN, **AGENT_STORE, "LAMPDIST_PORT": "40000"})
    assert (env.port, env.port_exchange) == (40000, None)


def test_slurm_variables_take_the_first_node() -> None:
    env = from_env(SLURM)
    assert (env.rank, env.nranks, env.local_rank) == (9, 16, 1)
    assert (env.host, env.port) == ("gpu07", 29501)
    assert from_env({**SLURM, "MASTER_ADDR": "10.1.2.3"}).host == "10.1.2.3"


def test_torchrun_wins_over_slurm() -> None:
    assert from_env({**SLURM, **TORCHRUN}).rank == 1


def test_lampdist_port_overrides_master_port() -> None:
    assert from_env({**TORCHRUN, "LAMPDIST_PORT": "40000"}).port == 40000


def test_secret_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"from-file\n")
    environ = {k: v for k, v in TORCHRUN.items() if k != "LAMPDIST_SECRET"}
    env = from_env({**environ, "LAMPDIST_SECRET_FILE": str(path)})
    assert env.secret == b"from-file"
    assert "from-file" not in repr(env) and "s3cret" not in repr(from_env(TORCHRUN))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": None}, "RANK is not set"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be an integer"),
        ({"RANK": "4"}, "rank 4 is not in 0..3"),
        ({"LOCAL_RANK": "2"}, "local rank 2 must be in 0..1"),
        ({"LAMPDIST_SECRET": None}, "set LAMPDIST_SECRET"),
        ({"LAMPDIST_SECRET": ""}, "LAMPDIST_SECRET is set but empty"),
        ({"LAMPDIST_SECRET_FILE": "/nonexistent/secret"}, "both LAMPDIST_SECRET and"),
        ({"LAMPDIST_PORT": "70000"}, "not in 1..65535"),
    ],
)
def test_missing_or_inconsistent_variables(change: dict[str, str | None], message: str) -> None:
    environ = dict(TORCHRUN)
    for name, value in change.items():
        if value is None:
            environ.pop(name)
        else:
            environ[name] = value
    with pytest.raises(lampdist.ConfigError, match=message):
        from_env(environ)


def test_unreadable_secret_file() -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != "LAMPDIST_SECRET"}
    with pytest.raises(lampdist.ConfigError, match="cannot read LAMPDIST_SECRET_FILE"):
        from_env({**environ, "LAMPDIST_SECRET_FILE": "/nonexistent/secret"})


def test_no_launcher() -> None:
    with pytest.raises(lampdist.ConfigError, match="not started by torchrun or srun"):
        from_env({"PATH": "/bin"})


def test_slurm_needs_a_port() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "MASTER_PORT"}
    with pytest.raises(lampdist.ConfigError, match="set MASTER_PORT"):
        from_env(environ)


def test_one_rank_needs_no_secret() -> None:
    env = from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert env.secret is None and env.is_root


def test_a_follower_needs_the_port() -> None:
    with pytest.raises(lampdist.ConfigError, match="needs the root's control port"):
        LaunchEnv(rank=1, nranks=2, secret="s")


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[07-08,12],cpu3", "gpu07"),
        ("gpu[3,5-6]", "gpu3"),
        ("rack[1-2]-node[001-004]", "rack1-node001"),
        ("n[10-11]-ib,m1", "n10-ib"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "gpu[07-08", "gpu]1["])
def test_malformed_slurm_node_list(nodelist: str) -> None:
    with pytest.raises(lampdist.ConfigError, match="cannot read the SLURM node list"):
        first_slurm_host(nodelist)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shard(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(24, 3, generator=generator)
    return [(inputs[i : i + 8], inputs[i : i + 8].sum(1, keepdim=True)) for i in (0, 8, 16)]


def sgd(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1)


async def train_two_ranks(
    launch: Callable[[int], LaunchEnv],
    *,
    validate: bool = False,
    follower_head_start: float = 0.0,
    max_epochs: int = 1,
) -> lampdist.LoopState:
    """``lampdist.train`` on ranks 1 and 0 (the follower started first) of one run; returns
    the root's state once both ranks hold the same weights."""
    modules = [torch.nn.Linear(3, 1) for _ in range(2)]
    results: dict[int, lampdist.LoopState] = {}

    async def rank(r: int) -> None:
        results[r] = await lampdist.train(
            data=lampdist.ModelWithData(
                model=lampdist.SupervisedModel(modules[r], torch.nn.functional.mse_loss),
                train_batches=lambda: shard(r),
                validation_batches=(lambda: shard(10 + r)) if validate else None,
            ),
            launch=launch(r),
            optimizer_factory=sgd,
            stop_on_signals=False,
            loop=lampdist.LoopOptions(max_epochs=max_epochs),
            timeouts=lampdist.Timeouts(join=20),
        )

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(rank, 1)
            await anyio.sleep(follower_head_start)
            group.start_soon(rank, 0)
    root = results[0]
    assert root is not None and results[1] == root  # every rank returns the final state
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return root


async def test_train_runs_the_root_on_rank_0_and_a_follower_elsewhere() -> None:
    port = free_port()
    root = await train_two_ranks(
        lambda r: LaunchEnv(rank=r, nranks=2, port=port, secret="test"),
        validate=True,
        max_epochs=2,
    )
    assert root.epoch == 2 and len(root.learning_curve) == 2


async def test_train_with_the_port_published_in_the_launchers_store() -> None:
    # The store plays torchrun's agent store; the root listens on a free port and publishes
    # it there, and the follower (started first) waits for it.
    agent_store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    exchange = PortExchange(host="127.0.0.1", port=agent_store.port, key="lampdist/test/0")
    await train_two_ranks(
        lambda r: LaunchEnv(rank=r, nranks=2, secret="test", port_exchange=exchange),
        follower_head_start=0.3,
    )
    assert int(agent_store.get(exchange.key)) > 0


async def test_a_follower_without_a_published_port_times_out_naming_its_rank() -> None:
    agent_store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    exchange = PortExchange(
        host="127.0.0.1", port=agent_store.port, key="lampdist/test/none", timeout=0.5
    )
    env = LaunchEnv(rank=1, nranks=2, secret="test", port_exchange=exchange)
    with anyio.fail_after(10), pytest.raises(lampdist.JoinTimeout) as caught:
        async with env.open_control():
            pass
    assert caught.value.rank == 1
    assert "read the root's control port" in str(caught.value)


async def test_cancelling_a_follower_waiting_for_the_port_ends_it_promptly() -> None:
    agent_store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    exchange = PortExchange(host="127.0.0.1", port=agent_store.port, key="lampdist/test/c")
    env = LaunchEnv(rank=1, nranks=2, secret="test", port_exchange=exchange)
    start = anyio.current_time()
    with anyio.move_on_after(0.5) as scope:
        async with env.open_control():
            pass
    assert scope.cancelled_caught
    assert anyio.current_time() - start < 5  # not the exchange's 60 s


async def test_train_over_tls() -> None:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    port = free_port()
    results: dict[int, lampdist.LoopState] = {}

    async def rank(r: int) -> None:
        results[r] = await lampdist.train(
            data=lampdist.ModelWithData(
                model=lampdist.SupervisedModel(torch.nn.Linear(3, 1), torch.nn.functional.mse_loss),
                train_batches=lambda: shard(r),
            ),
            launch=LaunchEnv(rank=r, nranks=2, port=port, secret="test"),
            optimizer_factory=sgd,
            ssl_context=server if r == 0 else client,
            stop_on_signals=False,
            loop=lampdist.LoopOptions(max_epochs=1),
            timeouts=lampdist.Timeouts(join=20),
        )

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(rank, 0)
            group.start_soon(rank, 1)
    root = results[0]
    assert root is not None and root.epoch == 1 and results[1] == root


async def test_train_with_one_rank_needs_no_network() -> None:
    module = torch.nn.Linear(3, 1)
    with anyio.fail_after(20):
        state = await lampdist.train(
            data=lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, torch.nn.functional.mse_loss),
                train_batches=lambda: shard(0),
            ),
            launch=LaunchEnv(rank=0, nranks=1),
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=1),
        )
    assert state is not None and state.epoch == 1


async def test_a_signal_asks_for_a_graceful_stop_and_raises_interrupted() -> None:
    ended: list[str] = []

    async def work(stop: anyio.Event) -> None:
        await anyio.wait_all_tasks_blocked()  # the signal receiver is installed now
        os.kill(os.getpid(), signal.SIGINT)
        await stop.wait()  # the run drains its epoch and stops
        ended.append("gracefully")

    with anyio.fail_after(10), pytest.raises(Interrupted, match="stopped by SIGINT") as caught:
        await run_until_signal(work, rank=3)
    assert ended == ["gracefully"]
    assert (caught.value.signum, caught.value.rank) == (signal.SIGINT, 3)


async def test_a_second_signal_cancels_the_work() -> None:
    cleaned_up = anyio.Event()

    async def work(stop: anyio.Event) -> None:
        try:
            await anyio.wait_all_tasks_blocked()
            os.kill(os.getpid(), signal.SIGTERM)
            await stop.wait()
            await anyio.wait_all_tasks_blocked()
            os.kill(os.getpid(), signal.SIGTERM)  # a run that would not stop in time
            await anyio.sleep_forever()
        finally:
            cleaned_up.set()

    with anyio.fail_after(10), pytest.raises(Interrupted, match="stopped by SIGTERM"):
        await run_until_signal(work)
    assert cleaned_up.is_set()


async def test_a_second_signal_interrupts_a_follower_too() -> None:
    """A follower (whose run ending normally after a signal is no interruption) that a second
    signal cancelled is interrupted: it has no result to return."""

    async def work(stop: anyio.Event) -> None:
        await anyio.wait_all_tasks_blocked()
        os.kill(os.getpid(), signal.SIGINT)
        await stop.wait()
        await anyio.wait_all_tasks_blocked()
        os.kill(os.getpid(), signal.SIGINT)
        await anyio.sleep_forever()

    with anyio.fail_after(10), pytest.raises(Interrupted, match="stopped by SIGINT"):
        await _run_until_signal(work, rank=1, done_is_interrupted=False)


async def test_a_failure_is_raised_as_it_is_whatever_signal_follows() -> None:
    """Under torchrun a dead rank is followed by SIGTERM to the others: the failure is the
    news, not the stop."""

    async def work(stop: anyio.Event) -> None:
        await anyio.wait_all_tasks_blocked()
        os.kill(os.getpid(), signal.SIGTERM)
        await stop.wait()
        raise lampdist.PeerDisconnected("the follower closed the connection", rank=1, phase="train")

    with anyio.fail_after(10), pytest.raises(lampdist.PeerDisconnected, match="rank 1"):
        await run_until_signal(work, rank=0)


async def test_a_run_the_stop_abandoned_is_interrupted() -> None:
    async def work(stop: anyio.Event) -> None:
        await anyio.wait_all_tasks_blocked()
        os.kill(os.getpid(), signal.SIGTERM)
        await stop.wait()
        raise lampdist.LampdistTimeout("abandoned", rank=0, phase="stop")

    with anyio.fail_after(10), pytest.raises(Interrupted, match="SIGTERM") as caught:
        await run_until_signal(work, rank=0)
    assert isinstance(caught.value.__cause__, lampdist.LampdistTimeout)


async def test_without_a_signal_the_result_comes_back() -> None:
    async def work(stop: anyio.Event) -> int:
        assert not stop.is_set()
        return 42

    assert await run_until_signal(work) == 42


async def test_the_error_of_the_work_comes_back_as_it_is() -> None:
    async def work(stop: anyio.Event) -> None:
        raise lampdist.ConfigError("bad", rank=2)

    with pytest.raises(lampdist.ConfigError, match="rank 2: bad"):
        await run_until_signal(work)


def test_launch_env_is_a_value() -> None:
    env = LaunchEnv(rank=0, nranks=2, port=5, secret="x")
    assert attrs.evolve(env, device=torch.device("cpu")) == env
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        env.rank = 1  # type: ignore[misc]


def test_the_launch_module_documents_its_names() -> None:
    assert lampdist.launch.__all__ == sorted(lampdist.launch.__all__)
    for name in lampdist.launch.__all__:
        assert getattr(lampdist.launch, name).__doc__, name
