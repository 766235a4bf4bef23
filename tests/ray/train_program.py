"""lampdist inside Ray Train's TorchTrainer, for tests/ray/test_train.py (run it in a
loopback-only namespace, see ``_namespace.py``)::

    python tests/ray/train_program.py OUT

One local Ray instance (2 CPUs, Ray Train's state tracking on), two TorchTrainer runs of 2
workers (Gloo), each calling ``lampdist.train`` in ``train_loop_per_worker`` with the launch
from ``lampdist.ray.from_train_context``, checkpoints into ``lampdist.ray.storage_dir()`` and
``lampdist.ray.report`` at the end:

- ``split``: 2 epochs; its ``Result.checkpoint`` is handed to ``resumed``;
- ``resumed``: a new run given ``split``'s checkpoint in ``train_loop_config``; 4 epochs.
  Its rank 1 exits in epoch 3 of its first attempt: Ray Train restarts both workers
  (``FailureConfig(max_failures=1)``) and they go on from lampdist's own newest checkpoint.

Each worker saves its final state dict to ``OUT/<run>-<rank>.pt`` and a summary to
``OUT/<run>-<rank>.json`` (what it resumed from, an all-reduce over Ray Train's default
group after lampdist's run), and appends what it resumed from when it starts to
``OUT/<run>-starts.jsonl``. The driver trains the uninterrupted reference, 4 epochs of the
same 2 ranks without Ray (``local_data_parallel_training_loop``), into ``OUT/whole.pt``,
and writes ``OUT/driver.json`` (the results' checkpoints and metrics, and Ray Train's stored
run settings as text).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import ray.train
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import lampdist
import lampdist.ray
import ray
from lampdist import checkpoint


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
    ).double()


def batches(rank: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed * 10 + rank)
    out = []
    for size in range(4, 4 + count):
        x = torch.randn(size, 3, generator=generator, dtype=torch.float64)
        out.append((x, (x.sum(dim=1, keepdim=True) * 0.5).sin()))
    return out


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


def rank_data(
    module: torch.nn.Module, rank: int, fault: Path | None = None
) -> lampdist.ModelWithData:
    def train_batches(context: lampdist.PassContext) -> list[Any]:
        if fault is not None and rank == 1 and context.epoch == 3 and not fault.exists():
            fault.write_text("rank 1 exits in epoch 3")  # once: the restart trains on
            os._exit(1)
        return batches(rank, 3, 1)

    return lampdist.ModelWithData(
        model=lampdist.SupervisedModel(module, mse),
        train_batches=train_batches,
        validation_batches=functools.partial(batches, rank, 1, 2),
    )


def train_loop_per_worker(config: dict[str, Any]) -> None:
    launch = lampdist.ray.from_train_context(config["lampdist_secret"])
    directory = lampdist.ray.storage_dir()
    resumed = lampdist.ray.resume(directory, config.get("checkpoint"))
    out = Path(config["out"])
    with (out / f"{config['run']}-starts.jsonl").open("a") as starts:
        where = None if resumed is None else str(resumed.path)
        starts.write(json.dumps({"rank": launch.rank, "resumed_from": where}) + "\n")
    module = make_model()
    fault = out / "fault" if config.get("fault") else None
    state = anyio.run(
        functools.partial(
            lampdist.train,
            data=rank_data(module, launch.rank, fault),
            optimizer_factory=adamw,
            loop=lampdist.LoopOptions(
                max_epochs=config["epochs"], checkpoint_state=checkpoint.to_directory(directory)
            ),
            resume=resumed,
            launch=launch,
            stop_on_signals=False,
        )
    )
    total = torch.tensor([float(launch.rank + 1)])
    torch.distributed.all_reduce(total)  # Ray Train's default group, after lampdist's
    name = f"{config['run']}-{launch.rank}"
    torch.save(module.state_dict(), out / f"{name}.pt")
    summary = {
        "rank": launch.rank,
        "nranks": launch.nranks,
        "host": launch.host,
        "port_exchange": launch.port_exchange is not None,
        "resumed_epoch": None if resumed is None else resumed.training_state.loop_state.epoch,
        "resumed_from": None if resumed is None else str(resumed.path),
        "directory": str(directory),
        "epochs": [point.epoch for point in state.learning_curve],
        "all_reduce": total.item(),
    }
    (out / f"{name}.json").write_text(json.dumps(summary))
    lampdist.ray.report(state, directory)


def fit(out: Path, run: str, epochs: int, secret: Any, given: Any = None) -> Any:
    config = {"lampdist_secret": secret, "out": str(out), "run": run, "epochs": epochs}
    if given is not None:
        config |= {"checkpoint": given, "fault": True}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=run,
            storage_path=str(out / "storage"),
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    return trainer.fit()


def stored_run_settings() -> str:
    """Ray Train's run state as its state API serves it (private API: a test's look)."""
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    return "" if actor is None else repr(ray.get(actor.get_train_runs.remote()))


def uninterrupted(out: Path, epochs: int) -> None:
    modules = [make_model(), make_model()]
    anyio.run(
        functools.partial(
            lampdist.local_data_parallel_training_loop,
            models_with_data_streams=[rank_data(m, rank) for rank, m in enumerate(modules)],
            optimizer_factory=adamw,
            loop=lampdist.LoopOptions(max_epochs=epochs),
        )
    )
    torch.save(modules[0].state_dict(), out / "whole.pt")


def main(out: Path) -> None:
    uninterrupted(out, 4)
    os.environ["RAY_TRAIN_ENABLE_STATE_TRACKING"] = "1"  # what Ray's dashboard shows
    ray.init(num_cpus=2, include_dashboard=False)
    secret = lampdist.ray.TrainSecret.new()
    split = fit(out, "split", 2, secret)
    resumed = fit(out, "resumed", 4, secret, given=split.checkpoint)
    results = {"split": split, "resumed": resumed}
    (out / "driver.json").write_text(
        json.dumps(
            {
                "checkpoints": {k: r.checkpoint and r.checkpoint.path for k, r in results.items()},
                "metrics": {k: r.metrics for k, r in results.items()},
                "errors": {k: repr(r.error) for k, r in results.items() if r.error},
                "run_settings": stored_run_settings(),
                "secret_hex": secret.value.hex(),
                "secret_text": str(secret.value),
            }
        )
    )
    ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
