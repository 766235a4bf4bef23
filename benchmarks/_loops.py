"""One rank of one benchmark configuration, run as its own process by ``throughput.py``.

    python benchmarks/_loops.py SPEC.json

reads a :class:`RunSpec`, builds the model and the rank's batches on its device, runs the
configuration's loop (warm-up steps, then timed steps) and writes a :class:`RankResult` as JSON
to ``spec.result_file``. Timing marks are taken after ``torch.cuda.synchronize`` at the
boundaries of the timed steps only. Every configuration runs in fresh processes, so peak
memory (``torch.cuda.max_memory_allocated`` on a GPU, the RSS high-water mark of
``resource.getrusage`` on CPU) belongs to that configuration alone. Each rank also reports the
bytes of the parameters, gradients and optimizer state it holds (of a sharded tensor, its local
shard).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import anyio
import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from _models import Batch, Workload, build_workload, original_module

SECRET_ENV = "LAMPDIST_BENCH_SECRET"
PROFILE_ENV = "LAMPDIST_BENCH_PROFILE"  # a directory: trace PROFILE_STEPS steps after warm-up
COMPILE_ENV = "LAMPDIST_BENCH_COMPILE"  # "1": every configuration trains torch.compile(module)
PROFILE_STEPS = 3
SIZED_KEY = "sized"  # a lampdist variant key of the benchmark's own: false for a bare generator
# A lampdist variant key of the benchmark's own: true for FsdpPolicy(shard_modules=<the model's
# blocks>), false for FsdpPolicy() (the root module alone); absent: StepOptions' default policy.
FSDP_BLOCKS_KEY = "fsdp_blocks"
# An fsdp variant key of the benchmark's own: false to fully_shard the root module alone.
BLOCKS_KEY = "blocks"
SETUP_TIMEOUT = timedelta(seconds=120)

Kind = Literal["single", "independent", "ddp", "fsdp", "lampdist"]


@attrs.frozen(kw_only=True)
class RunSpec:
    """What one rank of one configuration runs (written as JSON by the launcher)."""

    config: str
    kind: Kind
    model: str
    device_type: Literal["cpu", "cuda"]
    rank: int
    nranks: int
    steps: int
    warmup: int
    threads: int
    port: int
    ready_file: str
    result_file: str
    # A variant's keywords: DistributedDataParallel's constructor's, fully_shard's (and the
    # benchmark's own key ``blocks``), or lampdist's StepOptions (and the benchmark's own keys
    # ``sized`` and ``fsdp_blocks``).
    kwargs: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class RankResult:
    """What one rank measured. ``seconds`` and ``samples`` cover the timed steps; a rank that
    does not time (a lampdist follower) reports ``None``."""

    rank: int
    seconds: float | None
    timed_steps: int | None
    samples: int | None
    peak_memory_bytes: int
    optimizer_state_bytes: int = 0
    """The bytes of the state of every optimizer that stepped in this process (the slice
    optimizer of a sharded lampdist rank: what the rank holds; of a DTensor, its local
    shard)."""
    parameter_bytes: int = 0
    """The bytes of the model's parameters on this rank at the end (of a DTensor parameter,
    its local shard)."""
    gradient_bytes: int = 0
    """The bytes of the model's parameters' gradients on this rank (of a DTensor, its local
    shard): the larger of what they held as the first optimizer step of the process ended
    and at the end (gradients kept in flat buffers stay allocated; a plain loop's are set to
    None after each step). Buffers of DDP's own and FSDP2's transient unsharded gradients are
    not counted (peak memory includes them)."""
    progress_events: int | None = None
    """How many progress events reached lampdist's ``on_event`` (coalesced when the loop
    falls behind); None for the other configurations."""


_STEPPED: dict[int, torch.optim.Optimizer] = {}
_MODULES: list[nn.Module] = []  # the module whose parameters and gradients are counted
_GRADIENT_BYTES: list[int] = []  # the gradients' bytes as the first step ended


def _remember_stepped(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    _STEPPED[id(optimizer)] = optimizer
    if not _GRADIENT_BYTES and _MODULES:
        # once, outside the timed steps (the first step is a warm-up step)
        _GRADIENT_BYTES.append(gradient_bytes(_MODULES[0]))


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds on this rank: a DTensor's local shard, else the tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes() -> int:
    """The bytes of the state tensors of every optimizer that has stepped in this process."""
    return sum(
        local_bytes(value)
        for optimizer in _STEPPED.values()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )


def parameter_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s parameters on this rank."""
    return sum(local_bytes(parameter) for parameter in module.parameters())


def gradient_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s parameters' gradients on this rank now."""
    return sum(
        local_bytes(parameter.grad)
        for parameter in module.parameters()
        if parameter.grad is not None
    )


def held_bytes(device: torch.device) -> dict[str, int]:
    """A rank's result's memory fields: peak memory and the bytes of the parameters,
    gradients and optimizer state it holds."""
    module = _MODULES[0]
    return {
        "peak_memory_bytes": peak_memory(device),
        "parameter_bytes": parameter_bytes(module),
        "gradient_bytes": max([gradient_bytes(module), *_GRADIENT_BYTES]),
        "optimizer_state_bytes": optimizer_state_bytes(),
    }


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> int:
    """Peak bytes of this process: allocated on the GPU, or resident on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@attrs.define(eq=False)
class StepProfiler:
    """With ``$LAMPDIST_BENCH_PROFILE`` set to a directory, traces the last ``PROFILE_STEPS``
    warm-up steps on rank 0 (outside the timed steps) and writes ``<config>-rank0.json`` (a
    Chrome trace) and ``.txt`` (the operators by device time) there; otherwise does nothing.
    ``at_step(n)`` is called after step n (counted from 1; 0 before the first)."""

    spec: RunSpec
    _profile: Any = None

    def at_step(self, step: int) -> None:
        directory = os.environ.get(PROFILE_ENV)
        if not directory or self.spec.rank != 0:
            return
        first = max(0, self.spec.warmup - PROFILE_STEPS)
        if step == first and self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.start()
        elif step == self.spec.warmup and self._profile is not None:
            profile, self._profile = self._profile, None
            profile.stop()
            stem = Path(directory) / f"{self.spec.config}-rank{self.spec.rank}"
            stem.parent.mkdir(parents=True, exist_ok=True)
            profile.export_chrome_trace(str(stem) + ".json")
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = profile.key_averages().table(sort_by=sort, row_limit=25)
            Path(str(stem) + ".txt").write_text(table)


def create_optimizer(params: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW: fused on CUDA, foreach on CPU."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def training_step(
    module: nn.Module,
    workload: Workload,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    loss_scale: float = 1.0,
) -> Callable[[Batch], None]:
    """One plain step: forward under autocast, backward, optimizer step, zero the gradients.
    ``loss_scale`` multiplies the batch's mean loss before backward (``1 / nranks`` where the
    gradients are summed over the ranks)."""
    dtype = workload.spec.autocast_dtype
    loss_fn = workload.spec.loss_fn
    scaled = loss_scale != 1.0

    def step(batch: Batch) -> None:
        inputs, target = batch
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(module(inputs), target)
        if scaled:
            loss = loss * loss_scale
        loss.backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward is unannotated
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed_loop(
    step: Callable[[Batch], None],
    workload: Workload,
    spec: RunSpec,
    device: torch.device,
    *,
    before_timing: Callable[[], None] | None = None,
) -> float:
    """Run the warm-up steps, then time the timed steps; returns their seconds."""
    profiler = StepProfiler(spec)
    profiler.at_step(0)
    for index in range(spec.warmup):
        step(workload.batch(index))
        profiler.at_step(index + 1)
    synchronize(device)
    if before_timing is not None:
        before_timing()
    started = time.perf_counter()
    for index in range(spec.warmup, spec.warmup + spec.steps):
        step(workload.batch(index))
    synchronize(device)
    return time.perf_counter() - started


def init_default_group(spec: RunSpec, device: torch.device, backend: str) -> None:
    """The default process group, through MASTER_ADDR/MASTER_PORT set by the launcher."""
    dist.init_process_group(
        backend,
        rank=spec.rank,
        world_size=spec.nranks,
        timeout=SETUP_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )


def run_plain(spec: RunSpec, workload: Workload, device: torch.device) -> RankResult:
    """The plain single-device loop: alone (``single``) or on every rank at once with no
    communication (``independent``, a barrier on a CPU Gloo group aligns the starts)."""
    optimizer = create_optimizer(workload.module.parameters(), device)
    step = training_step(workload.module, workload, optimizer, device)
    if spec.kind == "single":
        seconds = timed_loop(step, workload, spec, device)
    else:
        init_default_group(spec, torch.device("cpu"), "gloo")
        try:
            seconds = timed_loop(step, workload, spec, device, before_timing=dist.barrier)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    return RankResult(
        rank=spec.rank,
        seconds=seconds,
        timed_steps=spec.steps,
        samples=spec.steps * workload.spec.batch_size,
        **held_bytes(device),
    )


def run_ddp(spec: RunSpec, workload: Workload, device: torch.device) -> RankResult:
    """torch DDP over every rank (NCCL on GPUs, Gloo on CPU); rank 0 times it.

    DDP's reducer holds the process group: it is freed before the group is destroyed, so
    that the group's threads end now, not during the interpreter's shutdown (where Gloo's
    teardown can abort the process: "terminate called without an active exception").
    """
    init_default_group(spec, device, "nccl" if device.type == "cuda" else "gloo")
    ddp: nn.parallel.DistributedDataParallel | None = None
    try:
        ddp = nn.parallel.DistributedDataParallel(
            workload.module,
            device_ids=[device] if device.type == "cuda" else None,
            **spec.kwargs,
        )
        optimizer = create_optimizer(ddp.parameters(), device)
        seconds = timed_loop(
            training_step(ddp, workload, optimizer, device), workload, spec, device
        )
        dist.barrier()
    finally:
        ddp = None  # the reducer and its reference to the group go here
        gc.collect()
        dist.destroy_process_group()
    return RankResult(
        rank=spec.rank,
        seconds=seconds if spec.rank == 0 else None,
        timed_steps=spec.steps if spec.rank == 0 else None,
        samples=spec.steps * workload.spec.batch_size * spec.nranks if spec.rank == 0 else None,
        **held_bytes(device),
    )


def shard_model(module: nn.Module, blocks: tuple[type[nn.Module], ...], **settings: Any) -> None:
    """FSDP2 as lampdist's ``step_on="fsdp"`` applies it: ``fully_shard`` each child module
    whose type is in ``blocks``, then the root module (with ``settings``: mesh and the
    variant's keywords); every unit then sums its gradients over the ranks (divide factor 1,
    sum reductions only)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for name, child in module.named_modules():
        if name and blocks and isinstance(child, blocks):
            fully_shard(child, **settings)
    fully_shard(module, **settings)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)


def run_fsdp(spec: RunSpec, workload: Workload, device: torch.device) -> RankResult:
    """torch FSDP2 over every rank (NCCL on GPUs, Gloo on CPU), the model's blocks sharded
    then the root, the gradients summed as lampdist's ``step_on="fsdp"`` sums them and each
    batch's mean loss divided by the ranks (every rank's batch has the same size), so an
    update is the mean over the global batch, as DDP's is; rank 0 times it."""
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = dict(spec.kwargs)
    blocks = workload.spec.blocks if kwargs.pop(BLOCKS_KEY, True) else ()
    init_default_group(spec, device, "nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = init_device_mesh(device.type, (spec.nranks,))
        shard_model(original_module(workload.module), blocks, mesh=mesh, **kwargs)
        optimizer = create_optimizer(workload.module.parameters(), device)
        step = training_step(
            workload.module, workload, optimizer, device, loss_scale=1.0 / spec.nranks
        )
        seconds = timed_loop(step, workload, spec, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return RankResult(
        rank=spec.rank,
        seconds=seconds if spec.rank == 0 else None,
        timed_steps=spec.steps if spec.rank == 0 else None,
        samples=spec.steps * workload.spec.batch_size * spec.nranks if spec.rank == 0 else None,
        **held_bytes(device),
    )


@attrs.frozen
class Batches:
    """The first ``total`` batches of ``workload``: a sized iterable, as a ``DataLoader`` is."""

    workload: Workload
    total: int

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[Batch]:
        return (self.workload.batch(index) for index in range(self.total))


def batch_source(
    workload: Workload, total: int, *, sized: bool = True
) -> Callable[[], Iterable[Batch]]:
    """The lampdist batch source: the same device tensors, step for step, as the plain loop.

    Sized by default, as the plain loop knows its step count. With ``sized=False`` (the
    variant key ``sized:false``) it is a bare generator: then a rank whose own batches have
    run out learns at every step whether another rank has one, which makes its host wait for
    its device."""

    def source() -> Iterable[Batch]:
        batches = Batches(workload, total)
        return batches if sized else iter(batches)

    return source


def mark_ready(path: str) -> None:
    """Tell the launcher that the root listens (an atomic rename)."""
    partial = Path(path + ".partial")
    partial.write_text("ready")
    partial.replace(path)


async def run_lampdist(spec: RunSpec, workload: Workload, device: torch.device) -> RankResult:
    """lampdist over every rank: rank 0 drives and times through ``on_event``, the rest follow."""
    import lampdist
    from lampdist import control

    secret = os.environ[SECRET_ENV]
    total = spec.warmup + spec.steps
    model = lampdist.SupervisedModel(workload.module, workload.spec.loss_fn)
    kwargs = dict(spec.kwargs)
    source = batch_source(workload, total, sized=bool(kwargs.pop(SIZED_KEY, True)))
    if FSDP_BLOCKS_KEY in kwargs:  # a policy holds classes: no JSON value can name it
        blocks = workload.spec.blocks if kwargs.pop(FSDP_BLOCKS_KEY) else ()
        kwargs["fsdp"] = lampdist.FsdpPolicy(shard_modules=blocks)
    # Every other variant key is a step option (step_on, bucket_cap_mb, ...).
    step = lampdist.StepOptions(autocast_dtype=workload.spec.autocast_dtype, **kwargs)
    if spec.rank > 0:
        async with control.tcp_follower(
            "127.0.0.1", spec.port, rank=spec.rank, secret=secret
        ) as follower:
            await lampdist.follow_distributed_training(
                data=lampdist.ModelWithData(model=model, train_batches=source),
                rank=spec.rank,
                nranks=spec.nranks,
                device=device,
                control=follower,
                optimizer_factory=lambda params: create_optimizer(params, device),
                step=step,
            )
        return RankResult(
            rank=spec.rank,
            seconds=None,
            timed_steps=None,
            samples=None,
            **held_bytes(device),
        )

    # The start of the timed steps, taken on the compute thread as the first timed batch's
    # forward begins (after the warm-up steps' device work, as the plain loop does), and the
    # end, when the pass's last progress event reaches the event loop. The hook removes
    # itself at the start mark: the timed steps run without it, as the plain loop's do (a
    # module with a forward hook takes nn.Module's slower call path every forward), and the
    # last event's batch count checks the pass instead.
    marks: list[float] = []
    forwards = 0
    passed: list[int] = []  # the last event's batches
    profiler = StepProfiler(spec)

    def before_forward(module: nn.Module, inputs: Any) -> None:
        nonlocal forwards
        profiler.at_step(forwards)
        if forwards == spec.warmup:
            synchronize(device)
            marks.append(time.perf_counter())
            hook.remove()  # safe here: nn.Module copies its hooks before calling them
        forwards += 1

    events = 0

    async def on_event(event: lampdist.PassEvent) -> None:
        # A progress callback as a user's would be: it costs the loop, never the steps.
        nonlocal events
        events += 1
        if event.kind == "train" and event.done:
            synchronize(device)  # a no-op: the pass has waited for its last step
            marks.append(time.perf_counter())
            passed.append(event.batches)

    hook = workload.module.register_forward_pre_hook(before_forward)
    try:
        async with control.tcp_root(
            "127.0.0.1", spec.port, nranks=spec.nranks, secret=secret
        ) as root:
            mark_ready(spec.ready_file)
            await lampdist.drive_distributed_training(
                data=lampdist.ModelWithData(model=model, train_batches=source),
                nranks=spec.nranks,
                device=device,
                control=root,
                optimizer_factory=lambda params: create_optimizer(params, device),
                loop=lampdist.LoopOptions(max_epochs=1, on_event=on_event),
                step=step,
            )
    finally:
        hook.remove()
    if len(marks) != 2 or forwards != spec.warmup + 1 or passed != [total]:
        raise RuntimeError(
            f"{spec.config}: expected a mark after {spec.warmup} batches and one at the end "
            f"of a pass of {total} batches, got {len(marks)} after {forwards} hooked forwards "
            f"and passes of {passed} batches; is --steps >= 1?"
        )
    start, end = marks
    return RankResult(
        rank=0,
        seconds=end - start,
        timed_steps=spec.steps,
        # every rank takes a batch of the same size at every step
        samples=spec.steps * workload.spec.batch_size * spec.nranks,
        **held_bytes(device),
        progress_events=events,
    )


def main(argv: list[str]) -> None:
    """Run the configuration the spec file ``argv[0]`` names and write the rank's result."""
    spec = RunSpec(**json.loads(Path(argv[0]).read_text()))
    register_optimizer_step_post_hook(_remember_stepped)
    if spec.device_type == "cuda":
        device = torch.device("cuda", spec.rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(spec.threads)
    workload = build_workload(spec.model, device, rank=spec.rank)
    _MODULES.append(workload.module)
    if os.environ.get(COMPILE_ENV) == "1":
        workload.module = torch.compile(workload.module)  # type: ignore[assignment]  # a wrapper
    if spec.kind == "lampdist":
        result = anyio.run(run_lampdist, spec, workload, device)
    elif spec.kind == "ddp":
        result = run_ddp(spec, workload, device)
    elif spec.kind == "fsdp":
        result = run_fsdp(spec, workload, device)
    else:
        result = run_plain(spec, workload, device)
    Path(spec.result_file).write_text(json.dumps(attrs.asdict(result)))
    if spec.kind != "lampdist":
        # torch's own loops end here without the interpreter's shutdown, whose C++
        # destructors (DDP's reducer holding its group; for FSDP2 on Gloo, seen once in CI
        # on rank 0 and not reproduced in 190 runs) can abort a process whose result is
        # written ("terminate called without an active exception"). lampdist's ranks end
        # through the interpreter: a rank that aborts there is a lampdist defect to see.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
