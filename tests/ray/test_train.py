"""lampdist inside Ray Train's TorchTrainer: a run finishes, its Result.checkpoint resumes
in a second run, which Ray Train restarts after a worker exits and which ends bitwise where
an uninterrupted run ends; Ray Train's default process group still works beside lampdist's,
and the secret stays out of Ray Train's run state. One Ray instance runs it all
(``train_program.py``, in a loopback-only namespace)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ._namespace import needs_loopback_namespace, run_in_loopback_namespace

pytest.importorskip("ray.train")

PROGRAM = Path(__file__).with_name("train_program.py")
SRC = Path(__file__).parents[2] / "src"


def _run(out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = run_in_loopback_namespace([str(PROGRAM), str(out)], timeout=240, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-8000:] + done.stderr[-8000:])
    assert done.returncode == 0
    return dict(json.loads((out / "driver.json").read_text()))


@pytest.mark.slow  # a Ray instance, two TorchTrainer runs and a restart: ~60-100 s
@needs_loopback_namespace
def test_a_torch_trainer_run_checkpoints_and_resumes_bitwise(tmp_path: Path) -> None:
    check(tmp_path, _run(tmp_path))


def check(tmp_path: Path, driver: dict[str, Any]) -> None:
    """The assertions on ``train_program.py``'s output in ``tmp_path``."""
    assert driver["errors"] == {}
    storage = tmp_path / "storage"
    # the first run reported the newest of lampdist's own checkpoints, under its name
    assert driver["checkpoints"]["split"] == str(storage / "split" / "epoch-000002")
    assert driver["metrics"]["split"]["epoch"] == 2
    assert driver["checkpoints"]["resumed"] == str(storage / "resumed" / "epoch-000004")
    written = (storage / "split" / "lampdist").glob("epoch-*")
    assert sorted(p.name for p in written) == ["epoch-000001", "epoch-000002"]
    summaries = [
        json.loads((tmp_path / f"{run}-{rank}.json").read_text())
        for run in ("split", "resumed")
        for rank in (0, 1)
    ]
    for summary in summaries:
        assert summary["nranks"] == 2
        assert summary["host"] == "127.0.0.1"
        assert summary["port_exchange"]
        assert summary["all_reduce"] == 3.0  # Ray Train's default group, after lampdist's run
    split0, split1, resumed0, resumed1 = summaries
    assert [split0["rank"], split1["rank"]] == [0, 1]
    assert split0["epochs"] == [0, 1]
    assert split0["resumed_from"] is None
    # the second run went on from the first's Result.checkpoint, on the root only; its
    # rank 1 exited in epoch 3, and Ray Train's restart went on from lampdist's own store
    starts = [
        json.loads(line) for line in (tmp_path / "resumed-starts.jsonl").read_text().splitlines()
    ]
    assert (tmp_path / "fault").exists()
    assert sorted((s["rank"], s["resumed_from"] or "") for s in starts) == sorted(
        [
            (0, driver["checkpoints"]["split"]),
            (0, str(storage / "resumed" / "lampdist" / "epoch-000003")),
            (1, ""),
            (1, ""),
        ]
    )
    assert resumed0["resumed_from"] == str(storage / "resumed" / "lampdist" / "epoch-000003")
    assert resumed0["resumed_epoch"] == 3
    assert resumed1["resumed_from"] is None
    assert resumed0["epochs"] == resumed1["epochs"] == [0, 1, 2, 3]
    whole = torch.load(tmp_path / "whole.pt")
    for rank in (0, 1):
        resumed = torch.load(tmp_path / f"resumed-{rank}.pt")
        assert whole.keys() == resumed.keys()
        for name, tensor in whole.items():
            assert torch.equal(tensor, resumed[name]), (rank, name)
    split = torch.load(tmp_path / "split-0.pt")
    assert not all(torch.equal(split[name], t) for name, t in whole.items())
    # Ray Train keeps train_loop_config in its run state (its dashboard's view): the
    # TrainSecret shows as hidden there, never its value
    settings = driver["run_settings"]
    assert "train_loop_config" in settings
    assert "TrainSecret(<hidden>)" in settings
    assert driver["secret_hex"] not in settings
    assert driver["secret_text"] not in settings


def test_the_secret_hides_its_value_and_travels_by_pickle() -> None:
    import pickle

    import lampdist.ray

    secret = lampdist.ray.TrainSecret.new()
    assert len(secret.value) == 32
    assert secret != lampdist.ray.TrainSecret.new()
    assert repr(secret) == str(secret) == "TrainSecret(<hidden>)"
    assert secret.value.hex() not in repr(secret)
    assert pickle.loads(pickle.dumps(secret)) == secret


def test_outside_a_ray_train_worker_is_a_config_error() -> None:
    import lampdist
    import lampdist.ray

    for call in (
        lambda: lampdist.ray.from_train_context(lampdist.ray.TrainSecret.new()),
        lampdist.ray.storage_dir,
    ):
        with pytest.raises(lampdist.ConfigError, match="inside TorchTrainer's train_loop_per"):
            call()


@pytest.mark.parametrize(
    "environ",
    [{}, {"MASTER_ADDR": "10.0.0.1"}, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "x"}],
)
def test_without_ray_trains_store_address_is_a_config_error(environ: dict[str, str]) -> None:
    import lampdist
    from lampdist.ray._train import _store_address

    with pytest.raises(lampdist.ConfigError, match='TorchConfig\\(init_method="env"\\)'):
        _store_address(environ, 0)
    assert _store_address({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, 1) == (
        "10.0.0.1",
        29500,
    )


def test_fsdp_beside_an_existing_default_group_is_refused() -> None:
    """A Ray Train worker has torch's default process group already, which step_on="fsdp"
    needs to itself: refused, saying so (docs/howto-ray-train.md); the group stays the
    worker's."""
    import anyio

    import lampdist
    from lampdist.launch import LaunchEnv

    store = torch.distributed.HashStore()  # type: ignore[attr-defined]
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        module = torch.nn.Linear(3, 1)
        batch = (torch.randn(4, 3), torch.randn(4, 1))

        async def run() -> None:
            await lampdist.train(
                launch=LaunchEnv(rank=0, nranks=1),
                data=lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, torch.nn.functional.mse_loss),
                    train_batches=lambda: [batch],
                ),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                loop=lampdist.LoopOptions(max_epochs=1),
                step=lampdist.StepOptions(step_on="fsdp"),
                stop_on_signals=False,
            )

        with pytest.raises(lampdist.LampdistError, match="already has torch's default process"):
            anyio.run(run)
        assert torch.distributed.is_initialized()  # not lampdist's to destroy
    finally:
        torch.distributed.destroy_process_group()
