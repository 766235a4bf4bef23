"""Checkpoint write throughput: lampdist.checkpoint.to_directory against a plain torch.save.

Writes a model state dict of ``--size-mb`` MB of float32 tensors, on ``--device`` (``cpu``
or ``cuda``), to the same disk these ways, ``--repeats`` times each, interleaved, after an
untimed warm-up, with no dirty pages in flight (``os.sync`` before every write, untimed):

- ``torch.save``: one file, no fsync (what most training scripts do; not crash safe);
- ``torch.save + fsync``: the same, made durable;
- ``to_directory``: lampdist's atomic checkpoint (a checksum of every byte, fsync of every
  file and directory, rename into place, fsync of the parent, pruning to ``keep=3``);
- ``dcp.save``: ``torch.distributed.checkpoint.save(state, checkpoint_id=dir, no_dist=True)``
  with its default ``FileSystemWriter`` (one thread, fsync on), no process group;
- ``to_directory async``: the same checkpoint written in the background, as the training
  entry points do with ``asynchronous=True``: ``BackgroundWriter.save`` stages the state
  into one reused host buffer (pinned on CUDA, the copies queued on the stream) and starts
  the write on a thread. Timed twice: how long ``save`` blocks the caller, and the total to
  the commit (``save``, then waiting for the write).

Prints a table (median and best of the repeats, each as GB/s and as a ratio to plain
``torch.save`` and to ``torch.save + fsync``, CPU seconds of all threads) and a JSON line,
also written to ``--json PATH``: the medians in seconds (``torch_save_seconds``,
``torch_save_fsync_seconds``, ``sync_seconds``, ``dcp_save_seconds``,
``async_blocked_seconds``, ``async_total_seconds``) and ratios ``X_vs_Y`` = Y's seconds / X's
(above 1: X is faster). The targets: ``to_directory`` >= 0.8x the throughput of a plain
torch.save; an asynchronous save blocks the caller <= 5% of a synchronous write's time.

``--s3`` also starts moto's S3 server on a free local port (stopped at the end) and, on a
state of ``--s3-size-mb`` MB (default: 256, or ``--size-mb`` if smaller; moto writes at
about 45 MB/s), times ``torch.save`` to memory + one ``obstore.put`` (the part size and
concurrency lampdist's uploads use) against ``checkpoint.to_url``, and ``obstore.get`` +
``torch.load`` against ``checkpoint.load_latest`` of the URL (``to_url_vs_put``,
``load_vs_get_load``: above 1, lampdist is faster).

``--train MODEL`` measures instead what checkpoints cost a training run: one rank
(``local_data_parallel_training_loop`` with one entry) trains MODEL (``mlp``, on a CPU
``--mlp-width`` 1024 wide by default; ``gpt`` on a GPU, see ``_models.py``) for ``--epochs``
epochs of ``--steps`` steps three times in one invocation: checkpointing never, with
``to_directory(asynchronous=False)`` and with ``to_directory(asynchronous=True)``, after every
epoch. The batch source notes the time it hands out each batch (no device synchronization is
added to the steps: on CUDA the host runs as far ahead as the GPU's queue allows), so the
interval between consecutive batches is one step. Per way: the median step, the first
``--after`` steps after each checkpoint as a multiple of it (max and mean), and the
epoch-boundary gap (last batch of an epoch to the first of the next) minus the same gap of
the run without checkpoints: what a checkpoint blocks training. The targets: the
asynchronous checkpoint blocks <= 5% of what the synchronous one blocks; the steps after a
checkpoint take <= 1.1x the median step (the mean of the first ``--after``). Point ``--dir``
at the disk the checkpoints will go to::

    python benchmarks/checkpoint_write.py --size-mb 256 --repeats 3 --json out.json   # CPU
    python benchmarks/checkpoint_write.py --size-mb 256 --repeats 3 --s3              # + moto
    python benchmarks/checkpoint_write.py --train mlp --epochs 4 --steps 30           # CPU
    # the GPU machine:
    python benchmarks/checkpoint_write.py --device cuda --size-mb 2048 --repeats 5 \\
        --dir /mnt/nvme --s3 --json write.json
    python benchmarks/checkpoint_write.py --train gpt --device cuda --epochs 6 --steps 200 \\
        --dir /mnt/nvme --json train.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import io
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import anyio
import attrs
import torch

import lampdist
from _models import MODELS, Batch, Workload, _mlp_batch, mlp
from lampdist import LoopState, TrainingState, checkpoint
from lampdist._checkpoint._background import background_writes


def make_model_state(
    size_mb: int, tensors: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    elements = size_mb * 2**20 // 4 // tensors
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(elements, generator=generator).to(device)
        for i in range(tensors)
    }


def plain_save(model_state: dict[str, torch.Tensor], path: Path, *, fsync: bool) -> None:
    torch.save(model_state, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dcp_save(model_state: dict[str, torch.Tensor], directory: Path) -> None:
    """torch's distributed checkpoint of ``model_state``, without a process group."""
    from torch.distributed.checkpoint import state_dict_saver

    with warnings.catch_warnings():  # that it assumes one process: it is told so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        state_dict_saver.save(model_state, checkpoint_id=directory, no_dist=True)


KEEP = 3
TARGET = 0.8
"""The goal: to_directory at >= this fraction of a plain torch.save's throughput."""
TARGET_ASYNC_BLOCKED = 0.05
"""The goal: an asynchronous checkpoint blocks the caller <= this fraction of a synchronous
write's time."""
TARGET_STEPS_AFTER = 1.1
"""The goal: the steps right after a checkpoint take <= this multiple of the median step."""
S3_SIZE_MB = 256
S3_BUCKET = "lampdist-bench"
SERVER_START_TIMEOUT = 60.0


def warm_up(model_state: dict[str, torch.Tensor], root: Path) -> None:
    """Fill and free as much page cache as the measurements will use, untimed.

    On a virtual machine the first write into never-touched memory is several times
    slower (the host backs guest pages lazily), which would penalise whichever method
    happens to grow the page cache first.
    """
    paths = [root / f"warm-up-{i}.pt" for i in range(KEEP + 2)]
    for path in paths:
        torch.save(model_state, path)
    for path in paths:
        path.unlink()
    os.sync()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(write: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (all threads of this process) of one write."""
    os.sync()  # start each write with no dirty pages of the previous one in flight
    started, cpu_started = time.perf_counter(), time.process_time()
    write()
    return time.perf_counter() - started, time.process_time() - cpu_started


async def timed_async(write: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """:func:`timed` of an awaited write."""
    os.sync()
    started, cpu_started = time.perf_counter(), time.process_time()
    await write()
    return time.perf_counter() - started, time.process_time() - cpu_started


async def here(function: Callable[[], Any]) -> Any:
    """The background writer's ``stage_on``: the copies run on this (the caller's) thread."""
    return function()


def training_state(model_state: dict[str, torch.Tensor], epoch: int) -> TrainingState:
    return TrainingState(
        loop_state=LoopState(epoch=epoch),
        model_state=model_state,
        optimizer_state={"state": {}, "param_groups": []},
    )


Samples = dict[str, list[tuple[float, float]]]
METHODS = ("torch.save", "torch.save + fsync", "to_directory", "dcp.save", "to_directory async")


async def measure_writes(
    model_state: dict[str, torch.Tensor], root: Path, repeats: int, device: torch.device
) -> tuple[Samples, list[float]]:
    """Every method's (wall, CPU) seconds per repeat, and the async saves' blocked seconds."""
    seconds: Samples = {method: [] for method in METHODS}
    blocked: list[float] = []
    save = checkpoint.to_directory(root / "checkpoints", keep=KEEP)
    in_background = checkpoint.to_directory(root / "async", keep=KEEP, asynchronous=True)
    warm_up(model_state, root)
    async with background_writes(in_background) as writer:  # type: ignore[arg-type]
        for repeat in range(-1, repeats):  # repeat -1 warms up, untimed
            synchronize(device)
            path = root / f"plain-{repeat}.pt"
            seconds["torch.save"].append(
                timed(functools.partial(plain_save, model_state, path, fsync=False))
            )
            path.unlink()
            path = root / f"durable-{repeat}.pt"
            seconds["torch.save + fsync"].append(
                timed(functools.partial(plain_save, model_state, path, fsync=True))
            )
            path.unlink()
            state = training_state(model_state, repeat + 1)
            seconds["to_directory"].append(await timed_async(functools.partial(save, state, None)))
            path = root / f"dcp-{repeat}"
            seconds["dcp.save"].append(timed(functools.partial(dcp_save, model_state, path)))
            shutil.rmtree(path)

            async def in_the_background(state: TrainingState = state) -> None:
                await writer.save(state, None, stage_on=here)
                await writer.finish()  # committed

            seconds["to_directory async"].append(await timed_async(in_the_background))
            blocked.append(writer.blocked[-1])
    for measured in seconds.values():
        del measured[0]  # the warm-up round
    del blocked[0]
    for directory in ("checkpoints", "async"):  # untimed: is the last one intact?
        loaded = checkpoint.load_latest(root / directory, map_location="cpu")
        if loaded is None or loaded.epoch != repeats:
            raise SystemExit(f"the last checkpoint in {directory}/ did not load back")
        del loaded
    return seconds, blocked


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 4) if denominator > 0 else None


def summarize_writes(seconds: Samples, blocked: list[float], nbytes: int) -> dict[str, Any]:
    def walls(method: str) -> list[float]:
        return [wall for wall, _ in seconds[method]]

    base_median = statistics.median(walls("torch.save"))
    base_best = min(walls("torch.save"))
    durable_median = statistics.median(walls("torch.save + fsync"))
    durable_best = min(walls("torch.save + fsync"))
    rows = []
    for method, measured in seconds.items():
        wall = walls(method)
        row = {
            "method": method,
            "median_s": round(statistics.median(wall), 4),
            "best_s": round(min(wall), 4),
            "median_gb_per_s": round(nbytes / statistics.median(wall) / 1e9, 3),
            "best_gb_per_s": round(nbytes / min(wall) / 1e9, 3),
            "median_vs_torch_save": round(base_median / statistics.median(wall), 3),
            "best_vs_torch_save": round(base_best / min(wall), 3),
            "median_vs_durable_save": round(durable_median / statistics.median(wall), 3),
            "best_vs_durable_save": round(durable_best / min(wall), 3),
            "median_cpu_s": round(statistics.median(cpu for _, cpu in measured), 4),
            "all_s": [round(w, 4) for w in wall],
        }
        if method == "to_directory async":
            row["median_blocked_s"] = round(statistics.median(blocked), 4)
            row["all_blocked_s"] = [round(b, 4) for b in blocked]
        rows.append(row)
    medians = {
        "torch_save_seconds": base_median,
        "torch_save_fsync_seconds": durable_median,
        "sync_seconds": statistics.median(walls("to_directory")),
        "dcp_save_seconds": statistics.median(walls("dcp.save")),
        "async_blocked_seconds": statistics.median(blocked),
        "async_total_seconds": statistics.median(walls("to_directory async")),
    }
    sync = medians["sync_seconds"]
    ratios = {
        "sync_vs_torch_save": ratio(base_median, sync),
        "sync_vs_torch_save_fsync": ratio(durable_median, sync),
        "sync_vs_dcp_save": ratio(medians["dcp_save_seconds"], sync),
        "async_total_vs_sync": ratio(sync, medians["async_total_seconds"]),
        "async_blocked_vs_sync": ratio(sync, medians["async_blocked_seconds"]),
        "async_blocked_fraction_of_sync": ratio(medians["async_blocked_seconds"], sync),
    }
    return {
        **{key: round(value, 4) for key, value in medians.items()},
        **ratios,
        "target_vs_torch_save": TARGET,
        "target_met_median": base_median / sync >= TARGET,
        "target_async_blocked_fraction_of_sync": TARGET_ASYNC_BLOCKED,
        "target_async_blocked_met": medians["async_blocked_seconds"] <= TARGET_ASYNC_BLOCKED * sync,
        "results": rows,
    }


def print_writes(summary: dict[str, Any], nbytes: int, args: argparse.Namespace) -> None:
    print(
        f"{nbytes / 1e9:.3f} GB in {args.tensors} tensors on {args.device}, "
        f"{args.repeats} repeats, {args.directory or tempfile.gettempdir()}"
    )
    print(f"{'':<20} {'---------- median ----------':>36} {'----------- best -----------':>36}")
    header = f"{'s':>7} {'GB/s':>6} {'x save':>7} {'x save+fsync':>13}"
    print(f"{'method':<20} {header}  {header} {'cpu s':>6}")
    for row in summary["results"]:
        cells = [
            f"{row[f'{kind}_s']:>7.3f} {row[f'{kind}_gb_per_s']:>6.2f} "
            f"{row[f'{kind}_vs_torch_save']:>7.2f} {row[f'{kind}_vs_durable_save']:>13.2f}"
            for kind in ("median", "best")
        ]
        print(f"{row['method']:<20} {cells[0]}  {cells[1]} {row['median_cpu_s']:>6.2f}")
    fraction = summary["async_blocked_fraction_of_sync"]
    print(
        f"to_directory: {summary['sync_vs_torch_save']:.2f}x torch.save's throughput "
        f"(target >= {TARGET}: {verdict(summary['target_met_median'])}), "
        f"{summary['sync_vs_dcp_save']:.2f}x dcp.save's"
    )
    print(
        f"to_directory async: blocks the caller {summary['async_blocked_seconds']:.4f} s "
        f"(median), {100 * fraction:.1f}% of the synchronous write's "
        f"{summary['sync_seconds']:.3f} s (target <= {100 * TARGET_ASYNC_BLOCKED:.0f}%: "
        f"{verdict(summary['target_async_blocked_met'])}); committed after "
        f"{summary['async_total_seconds']:.3f} s"
    )


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


# ---------------------------------------------------------------------------- object store


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server on a free local port, for the ``with`` block; its endpoint URL.

    Sets the environment variables through which obstore (and so lampdist) reaches it,
    restores them and stops the server on leaving, after an error too."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()  # noqa: SIM115  # closed below, after the server
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    environment = {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in environment}
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if server.poll() is not None:
                log.seek(0)
                output = log.read().decode(errors="replace")[-2000:]
                raise SystemExit(f"moto's server exited ({server.returncode}):\n{output}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"moto's server did not listen within {SERVER_START_TIMEOUT:g} s"
                    ) from None
                time.sleep(0.1)
        os.environ.update(environment)
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def upload_settings(nbytes: int) -> dict[str, int]:
    """``obstore.put``'s part size and concurrency for ``nbytes``, as lampdist's uploads
    choose them."""
    from lampdist._checkpoint._store_client import MAX_CONCURRENCY, part_bytes

    return {"chunk_size": part_bytes(nbytes), "max_concurrency": MAX_CONCURRENCY}


def open_store(url: str) -> Any:
    """The obstore store of ``url`` with lampdist's client settings (timeouts, retries)."""
    from lampdist._checkpoint._store_client import open_store as open_lampdist_store

    return open_lampdist_store(url, None)


S3_METHODS = ("obstore.put", "to_url", "obstore.get + torch.load", "load_latest url")


def measure_s3(
    model_state: dict[str, torch.Tensor], repeats: int, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Wall seconds per repeat of each way to write to and read from moto's S3 server."""
    import boto3  # type: ignore[import-untyped]  # moto's dependency, without stubs
    import obstore

    seconds: dict[str, list[float]] = {method: [] for method in S3_METHODS}
    settings = upload_settings(sum(t.numel() * t.element_size() for t in model_state.values()))
    with moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=S3_BUCKET)
        store = open_store(f"s3://{S3_BUCKET}/plain")
        url = f"s3://{S3_BUCKET}/checkpoints"
        save = checkpoint.to_url(url, keep=KEEP)

        def put(key: str) -> None:
            buffer = io.BytesIO()
            torch.save(model_state, buffer)
            obstore.put(store, key, buffer.getbuffer(), **settings)  # type: ignore[arg-type]

        def get_load(key: str) -> None:
            data = obstore.get(store, key).bytes()
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

        def load_latest(epoch: int) -> None:
            loaded = checkpoint.load_latest(url, map_location="cpu")
            if loaded is None or loaded.epoch != epoch:
                raise SystemExit(f"the checkpoint of epoch {epoch - 1} did not load back")

        for repeat in range(-1, repeats):  # repeat -1 warms up, untimed
            synchronize(device)
            key = f"state-{repeat}.pt"
            seconds["obstore.put"].append(timed(functools.partial(put, key))[0])
            seconds["obstore.get + torch.load"].append(timed(functools.partial(get_load, key))[0])
            obstore.delete(store, key)
            state = training_state(model_state, repeat + 1)
            to_url = functools.partial(anyio.run, save, state, None)
            seconds["to_url"].append(timed(to_url)[0])
            seconds["load_latest url"].append(timed(functools.partial(load_latest, repeat + 1))[0])
    for measured in seconds.values():
        del measured[0]
    return seconds, settings


def summarize_s3(
    seconds: dict[str, list[float]], nbytes: int, settings: dict[str, int]
) -> dict[str, Any]:
    medians = {
        "s3_put_seconds": statistics.median(seconds["obstore.put"]),
        "to_url_seconds": statistics.median(seconds["to_url"]),
        "s3_get_load_seconds": statistics.median(seconds["obstore.get + torch.load"]),
        "load_latest_url_seconds": statistics.median(seconds["load_latest url"]),
    }
    return {
        "s3_bytes": nbytes,
        "s3_upload_settings": settings,
        **{key: round(value, 4) for key, value in medians.items()},
        "to_url_vs_put": ratio(medians["s3_put_seconds"], medians["to_url_seconds"]),
        "load_vs_get_load": ratio(
            medians["s3_get_load_seconds"], medians["load_latest_url_seconds"]
        ),
        "s3_results": [
            {
                "method": method,
                "median_s": round(statistics.median(walls), 4),
                "best_s": round(min(walls), 4),
                "median_mb_per_s": round(nbytes / statistics.median(walls) / 1e6, 1),
                "all_s": [round(w, 4) for w in walls],
            }
            for method, walls in seconds.items()
        ],
    }


def print_s3(summary: dict[str, Any]) -> None:
    print(
        f"\nS3 (moto, local): {summary['s3_bytes'] / 1e9:.3f} GB, parts of "
        f"{summary['s3_upload_settings']['chunk_size'] / 2**20:g} MiB, "
        f"{summary['s3_upload_settings']['max_concurrency']} at once"
    )
    print(f"{'method':<26} {'median s':>9} {'best s':>8} {'MB/s':>7}")
    for row in summary["s3_results"]:
        print(
            f"{row['method']:<26} {row['median_s']:>9.3f} {row['best_s']:>8.3f} "
            f"{row['median_mb_per_s']:>7.1f}"
        )
    print(
        f"to_url vs torch.save + put: {summary['to_url_vs_put']:.2f}x; load_latest vs "
        f"get + torch.load: {summary['load_vs_get_load']:.2f}x (>= 1: lampdist as fast or faster)"
    )


# ---------------------------------------------------------------------------- training

Way = Literal["none", "sync", "async"]
WAYS: tuple[Way, ...] = ("none", "sync", "async")


@attrs.frozen
class EpochBatches:
    """One epoch's batches of ``workload``: a sized iterable, as a DataLoader is."""

    workload: Workload
    first: int
    steps: int

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Batch]:
        return (self.workload.batch(i) for i in range(self.first, self.first + self.steps))


def train_workload(args: argparse.Namespace, device: torch.device) -> Workload:
    """``build_workload``'s model and batches; the ``mlp`` at ``--mlp-width`` x
    ``--mlp-depth``, and ``--batch-size`` when given."""
    spec = MODELS[args.train]
    if args.train == "mlp":
        width, depth = args.mlp_width, args.mlp_depth
        spec = attrs.evolve(
            spec, build=lambda: mlp(width=width, depth=depth), make_batch=_mlp_batch(width)
        )
    if args.batch_size is not None:
        spec = attrs.evolve(spec, batch_size=args.batch_size)
    torch.manual_seed(0)
    module = spec.build().to(device)
    generator = torch.Generator(device=device).manual_seed(1000)
    pool = [spec.make_batch(spec.batch_size, generator, device) for _ in range(8)]
    return Workload(spec=spec, module=module, pool=pool)


def create_optimizer(params: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (a state twice the model's): fused on CUDA, foreach on CPU (as ``_loops``)."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def train(
    way: Way, args: argparse.Namespace, device: torch.device, directory: Path
) -> tuple[list[list[float]], int]:
    """Train one rank; when each epoch's steps began, and the checkpoint's bytes.

    A step begins as its forward does, on the compute thread (a forward pre-hook: no device
    synchronization). The batch source's hand-outs would not do: lampdist's loading thread
    takes batches a few ahead, two at a time."""
    workload = train_workload(args, device)
    starts: list[float] = []

    def source(context: lampdist.PassContext) -> EpochBatches:
        return EpochBatches(workload, context.epoch * args.steps, args.steps)

    def stamp(module: torch.nn.Module, inputs: Any) -> None:
        starts.append(time.perf_counter())

    effect = (
        None
        if way == "none"
        else checkpoint.to_directory(directory / way, keep=KEEP, asynchronous=way == "async")
    )

    async def run() -> None:
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(workload.module, workload.spec.loss_fn),
                    train_batches=source,
                )
            ],
            optimizer_factory=functools.partial(create_optimizer, device=device),
            loop=lampdist.LoopOptions(max_epochs=args.epochs, checkpoint_state=effect),
            step=lampdist.StepOptions(autocast_dtype=workload.spec.autocast_dtype),
        )

    hook = workload.module.register_forward_pre_hook(stamp)
    try:
        anyio.run(run)
    finally:
        hook.remove()
    parameters = sum(p.numel() * p.element_size() for p in workload.module.parameters())
    if len(starts) != args.epochs * args.steps:
        raise RuntimeError(f"{way}: expected {args.epochs} epochs of {args.steps} forwards")
    stamps = [starts[e * args.steps : (e + 1) * args.steps] for e in range(args.epochs)]
    return stamps, 3 * parameters  # the model and AdamW's two moments


def summarize_training(
    stamps: dict[Way, list[list[float]]], after: int
) -> dict[Way, dict[str, Any]]:
    def gaps(way: Way) -> list[float]:
        epochs = stamps[way]
        return [epochs[e + 1][0] - epochs[e][-1] for e in range(len(epochs) - 1)]

    summary: dict[Way, dict[str, Any]] = {}
    for way, epochs in stamps.items():
        steps = [b - a for epoch in epochs for a, b in itertools.pairwise(epoch)]
        median = statistics.median(steps)
        # the first `after` steps of every epoch after the first: each follows a checkpoint
        per_checkpoint = [
            [(b - a) / median for a, b in itertools.pairwise(epoch[: after + 1])]
            for epoch in epochs[1:]
        ]
        following = [multiple for steps_after in per_checkpoint for multiple in steps_after]
        blocked = [ours - none for ours, none in zip(gaps(way), gaps("none"), strict=True)]
        summary[way] = {
            "median_step_seconds": round(median, 5),
            "steps_after_checkpoint_vs_median": {
                "max": round(max(following), 3),
                "mean": round(statistics.mean(following), 3),
            },
            "steps_after_checkpoint_vs_median_all": [
                [round(multiple, 2) for multiple in steps_after] for steps_after in per_checkpoint
            ],
            "epoch_gap_seconds": [round(gap, 4) for gap in gaps(way)],
            "blocked_per_checkpoint_seconds": round(statistics.median(blocked), 4),
            "blocked_per_checkpoint_all_seconds": [round(b, 4) for b in blocked],
        }
    return summary


def run_training(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="lampdist-bench-", dir=args.directory))
    stamps: dict[Way, list[list[float]]] = {}
    try:
        for way in WAYS:
            print(f"training: checkpoints {way} ...", flush=True)
            stamps[way], nbytes = train(way, args, device, root)
            gc.collect()  # the last way's model, optimizer and staging buffer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(root)
    ways = summarize_training(stamps, args.after)
    sync = ways["sync"]["blocked_per_checkpoint_seconds"]
    asynchronous = ways["async"]["blocked_per_checkpoint_seconds"]
    fraction = ratio(asynchronous, sync)
    after = ways["async"]["steps_after_checkpoint_vs_median"]
    return {
        "benchmark": "checkpoint_write",
        "mode": "train",
        "model": args.train,
        "describe": train_workload_description(args),
        "device": str(device),
        "epochs": args.epochs,
        "steps": args.steps,
        "after": args.after,
        "state_bytes": nbytes,
        "directory": str(root.parent),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "ways": ways,
        "async_vs_sync_blocked": fraction,
        "target_async_vs_sync_blocked": TARGET_ASYNC_BLOCKED,
        "target_async_blocked_met": fraction is not None and fraction <= TARGET_ASYNC_BLOCKED,
        "target_steps_after_checkpoint_vs_median": TARGET_STEPS_AFTER,
        "target_steps_after_met_mean": after["mean"] <= TARGET_STEPS_AFTER,
    }


def train_workload_description(args: argparse.Namespace) -> str:
    if args.train == "mlp":
        return f"MLP {args.mlp_depth} x {args.mlp_width}, AdamW"
    return f"{MODELS[args.train].describe}, AdamW"


def print_training(report: dict[str, Any]) -> None:
    print(
        f"\n{report['describe']} on {report['device']}, {report['epochs']} epochs of "
        f"{report['steps']} steps, a checkpoint of {report['state_bytes'] / 1e6:.1f} MB "
        f"after each, {report['directory']}"
    )
    print(
        f"{'checkpoints':<12} {'median step ms':>15} {'gap ms (median)':>16} "
        f"{'blocked ms/ckpt':>16} {'after ckpt: max':>16} {'mean':>6}"
    )
    for way, row in report["ways"].items():
        after = row["steps_after_checkpoint_vs_median"]
        print(
            f"{way:<12} {1000 * row['median_step_seconds']:>15.2f} "
            f"{1000 * statistics.median(row['epoch_gap_seconds']):>16.2f} "
            f"{1000 * row['blocked_per_checkpoint_seconds']:>16.2f} "
            f"{after['max']:>15.2f}x {after['mean']:>5.2f}x"
        )
    fraction = report["async_vs_sync_blocked"]
    shown = "n/a" if fraction is None else f"{100 * fraction:.1f}%"
    print(
        f"async blocks {shown} of what sync blocks (target <= "
        f"{100 * TARGET_ASYNC_BLOCKED:.0f}%: {verdict(report['target_async_blocked_met'])}); "
        f"steps after an async checkpoint "
        f"{report['ways']['async']['steps_after_checkpoint_vs_median']['mean']:.2f}x the "
        f"median (mean of the first {report['after']}; target <= {TARGET_STEPS_AFTER}x: "
        f"{verdict(report['target_steps_after_met_mean'])})"
    )


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="model size in MB (2**20 B)")
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    parser.add_argument(
        "--dir",
        "--directory",
        dest="directory",
        type=Path,
        default=None,
        help="write into a scratch directory made here (default: the system's temp dir)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--s3", action="store_true", help="also time to_url on moto's S3")
    parser.add_argument(
        "--s3-size-mb",
        type=int,
        default=None,
        help=f"the state written to S3 (default: {S3_SIZE_MB}, or --size-mb if smaller)",
    )
    parser.add_argument(
        "--train", choices=("mlp", "gpt"), default=None, help="time a training run instead"
    )
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch")
    parser.add_argument("--after", type=int, default=5, help="steps timed after a checkpoint")
    parser.add_argument("--mlp-width", type=int, default=1024)
    parser.add_argument("--mlp-depth", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the model's")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)

    if args.train is not None:
        if args.epochs < 2 or args.steps < args.after + 2:
            parser.error("--train needs --epochs >= 2 and --steps >= --after + 2")
        report = run_training(args, device)
        print_training(report)
    else:
        report = write_report(args, device)
    print(json.dumps(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def write_report(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model_state = make_model_state(args.size_mb, args.tensors, device)
    nbytes = sum(t.numel() * t.element_size() for t in model_state.values())
    root = Path(tempfile.mkdtemp(prefix="lampdist-bench-", dir=args.directory))
    try:
        seconds, blocked = anyio.run(measure_writes, model_state, root, args.repeats, device)
    finally:
        shutil.rmtree(root)
    del model_state
    summary = summarize_writes(seconds, blocked, nbytes)
    print_writes(summary, nbytes, args)
    report = {
        "benchmark": "checkpoint_write",
        "bytes": nbytes,
        "tensors": args.tensors,
        "repeats": args.repeats,
        "device": str(device),
        "directory": str(root.parent),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        **summary,
    }
    if args.s3:
        size_mb = args.s3_size_mb or min(S3_SIZE_MB, args.size_mb)
        s3_state = make_model_state(size_mb, args.tensors, device)
        s3_bytes = sum(t.numel() * t.element_size() for t in s3_state.values())
        s3_seconds, settings = measure_s3(s3_state, args.repeats, device)
        s3 = summarize_s3(s3_seconds, s3_bytes, settings)
        print_s3(s3)
        report.update(s3)
    return report


if __name__ == "__main__":
    main()
