"""Every Python snippet in the README and the docs runs, as the page shows it.

The blocks of a page run in order in one namespace, in a scratch directory, on the CPU, as a
run of one rank (``torchrun``'s variables for ``RANK=0, WORLD_SIZE=1``). What a page leaves to
the reader is supplied here, and nothing else is changed:

- a name the page uses without defining it (``dataset``, ``ranks``, ...) comes from the
  page's ``given`` namespace;
- ``name=...`` in a call is the page saying "yours": the value comes from ``given[name]``;
- ``...`` as a positional argument stands for "the other arguments": the call gets the
  keyword arguments listed for that function in ``rest``, except those the page passes;
- ``...`` as a statement stays what it is (nothing);
- ``max_epochs`` constants above 3 become 3, so that every page runs in seconds.

Functions a page defines without calling them are awaited by the page's ``then``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

import lampdist
from lampdist import checkpoint, schedules
from lampdist._wakeup import on_event_loop_thread
from lampdist.control import local_channels

from ..checkpoint.s3_server import set_environment, start_server
from .test_docs_code import blocks
from .test_examples import load

ROOT_DIR = Path(__file__).resolve().parents[2]
MAX_EPOCHS = 3


def _is_ellipsis(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


class _Yours(ast.NodeTransformer):
    """Rewrites a page's placeholders into lookups of what the test supplies."""

    def __init__(self, overrides: dict[str, str]) -> None:
        self.overrides = overrides

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        rest = any(_is_ellipsis(arg) for arg in node.args)
        node.args = [arg for arg in node.args if not _is_ellipsis(arg)]
        for keyword in node.keywords:
            if keyword.arg in self.overrides:
                keyword.value = ast.parse(self.overrides[keyword.arg], mode="eval").body
            elif keyword.arg is not None and _is_ellipsis(keyword.value):
                keyword.value = ast.parse(f"__given__[{keyword.arg!r}]", mode="eval").body
            elif (
                keyword.arg == "max_epochs"
                and isinstance(keyword.value, ast.Constant)
                and isinstance(keyword.value.value, int)
                and keyword.value.value > MAX_EPOCHS
            ):
                keyword.value = ast.Constant(MAX_EPOCHS)
        if rest:
            passed = tuple(keyword.arg for keyword in node.keywords if keyword.arg)
            call = f"__rest__({ast.unparse(node.func)!r}, {passed!r})"
            node.keywords.append(ast.keyword(arg=None, value=ast.parse(call, mode="eval").body))
        return ast.fix_missing_locations(node)


def run_block(code: str, namespace: dict[str, Any], name: str, **overrides: str) -> None:
    tree = ast.parse(code)
    tree = _Yours(overrides).visit(tree)
    compiled = compile(tree, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if compiled.co_flags & inspect.CO_COROUTINE:

        async def top_level() -> None:
            await eval(compiled, namespace)  # the page's own code

        anyio.run(top_level)
    else:
        exec(compiled, namespace)  # the page's own code


# What the pages leave to the reader.


def batches(rank: int = 0, nranks: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s share of a small regression problem (8 features)."""
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(64, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    return [(inputs[i : i + 16], targets[i : i + 16]) for i in range(0, 64, 16)]


def regression(*, seed: int = 0) -> lampdist.SupervisedModel:
    torch.manual_seed(seed)
    return lampdist.SupervisedModel(torch.nn.Linear(8, 1), torch.nn.functional.mse_loss)


def sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05)


def one_rank() -> lampdist.ModelWithData:
    return lampdist.ModelWithData(
        model=regression(),
        train_batches=batches,
        validation_batches=lambda: batches()[:2],
    )


def rest(data: lampdist.ModelWithData, control: Any) -> dict[str, dict[str, Any]]:
    """The arguments that ``f(..., ...)`` leaves out, by function."""
    root = {
        "nranks": 1,
        "device": "cpu",
        "control": control,
        "data": data,
        "optimizer_factory": sgd,
        "loop": lampdist.LoopOptions(max_epochs=2),
    }
    return {
        "lampdist.drive_distributed_training": root,
        "lampdist.train": {key: root[key] for key in ("data", "optimizer_factory", "loop")},
    }


def classification_ranks(nranks: int = 2) -> list[lampdist.ModelWithData]:
    ranks = []
    for rank in range(nranks):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        inputs = torch.randn(64, 16, generator=torch.Generator().manual_seed(rank))
        labels = (inputs.sum(dim=1) > 0).long()
        shard = [(inputs[i : i + 16], labels[i : i + 16]) for i in range(0, 64, 16)]
        ranks.append(
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, torch.nn.functional.cross_entropy),
                train_batches=lambda shard=shard: shard,
                validation_batches=lambda shard=shard: shard[:2],
            )
        )
    return ranks


@attrs.define
class Page:
    given: Callable[[Path], dict[str, Any]] = lambda _: {}
    then: Callable[[dict[str, Any]], Awaitable[object]] | None = None
    s3_bucket: str | None = None
    """A bucket of this name on a real S3 server (moto's, on 127.0.0.1) that the page's URLs
    reach, through the environment a user sets."""


def _tls_files(directory: Path) -> dict[str, Any]:
    trustme = pytest.importorskip("trustme")
    authority = trustme.CA()
    certificate = authority.issue_cert("node-a")
    certificate.private_key_pem.write_to_path(str(directory / "root.key"))
    certificate.cert_chain_pems[0].write_to_path(str(directory / "root.pem"))
    authority.cert_pem.write_to_path(str(directory / "ca.pem"))
    return {}


def _service(_: Path) -> dict[str, Any]:
    service = load("job_service")
    ranks = [
        lampdist.ModelWithData(
            model=regression(), train_batches=lambda rank=rank: service.make_shard(rank)
        )
        for rank in range(2)
    ]
    return {
        "lampdist": lampdist,
        "anyio": anyio,
        "ranks": ranks,
        "adam": service.adam,
        "Job": service.Job,
        "JobRunner": service.JobRunner,
        "ended_by_stop": service.ended_by_stop,
        "Starlette": service.Starlette,
        "AsyncIterator": service.AsyncIterator,
        "asynccontextmanager": service.asynccontextmanager,
    }


async def _run_the_job(namespace: dict[str, Any]) -> None:
    job = namespace["job"] = namespace["Job"](id=1, epochs=2)
    await namespace["_run"](None, job)  # the runner's method, as the page shows it
    assert job.status == "done", job.error
    assert [event.get("epoch") for event in job.events] == [0, 1, None]


async def _open_the_service(namespace: dict[str, Any]) -> None:
    app = namespace["Starlette"]()
    async with namespace["lifespan"](app):
        assert isinstance(app.state.runner, namespace["JobRunner"])
    await _run_the_job(namespace)


async def then_main(namespace: dict[str, Any]) -> None:
    async with namespace["__control__"]:  # the channel the page leaves to the reader
        await namespace["main"]()


async def then_object_store_main(namespace: dict[str, Any]) -> None:
    """The page's run, then what it wrote: its last checkpoint, committed, in the bucket."""
    await then_main(namespace)
    loaded = await anyio.to_thread.run_sync(checkpoint.load_latest, namespace["RUN"])
    assert loaded is not None and loaded.epoch == MAX_EPOCHS


async def then_root(namespace: dict[str, Any]) -> None:
    async with namespace["__control__"]:
        assert await namespace["root"]() == 0


async def then_resume_loop(namespace: dict[str, Any]) -> None:
    final = namespace["final"]  # resumed at epoch 1, up to max_epochs (3 here)
    assert final.epoch == MAX_EPOCHS
    assert [point.epoch for point in final.learning_curve] == [1, 2]


def _loop_page(_: Path) -> dict[str, Any]:
    async def train_epoch(lr_factor: float) -> float:
        return 0.5 * lr_factor

    schedule = schedules.reduce_on_plateau(patience=1)
    return {
        "model": regression(),  # the sets of "Several validation sets"
        "train_source": batches,
        "val_source": lambda: batches()[:2],
        "train_eval_source": lambda: batches()[2:],
        "make_optimizer": sgd,
        "train_epoch": train_epoch,
        "schedule": schedule,
        "saved_loop_state": lampdist.LoopState(epoch=1),
        "saved_lr_json": schedules.state_to_json(schedule.init),
    }


def _shared(directory: Path) -> dict[str, Any]:
    data = one_rank()
    control = local_channels(1)[0]
    return {
        "__control__": control,
        "__given__": {
            "data": data,
            "model": data.model,
            "train_batches": data.train_batches,
            "optimizer_factory": sgd,
            "max_epochs": 2,
        },
        "__rest__": lambda function, passed: {
            key: value for key, value in rest(data, control)[function].items() if key not in passed
        },
    }


def _trackers_page(directory: Path) -> dict[str, Any]:
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    namespace = _shared(directory)
    namespace["__given__"]["tracking_uri"] = f"file://{directory / 'mlruns'}"
    return namespace


def _written_by_main() -> None:
    assert list(Path("runs/digits").glob("events.out.tfevents.*"))
    assert Path("runs/digits/csv/summary.csv").read_text().startswith("name,value\n")


async def then_trackers(namespace: dict[str, Any]) -> None:
    """The first block wrote TensorBoard and CSV files; ``root`` makes a finished MLflow run
    with the hyperparameters and the summary."""
    _written_by_main()
    async with namespace["__control__"]:
        state = await namespace["root"]()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=namespace["__given__"]["tracking_uri"])
    experiment = client.get_experiment_by_name("digits")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model/width"] == "64"
    assert run.data.metrics["summary/epochs"] == state.epoch


class _Block(torch.nn.Module):
    """A block of the big-models page's model."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class _Model(torch.nn.Module):
    """The big-models page's ``GPT(config)``: ``config`` blocks of 8, then a head of 1."""

    def __init__(self, config: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(config))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _big_models_page(directory: Path) -> dict[str, Any]:
    """A model of blocks built on the meta device, trained by fsdp on one rank (a mesh of
    one, torch's default group opened and destroyed by the clique in this process)."""
    namespace = _shared(directory)
    namespace |= {"GPT": _Model, "Block": _Block, "config": 2, "loss": torch.nn.functional.mse_loss}
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator))]
    namespace["__given__"]["train_batches"] = lambda: batches
    # "Start from stored weights": a tiny GPT2 saved where the page reads it (nothing fetched)
    transformers: Any = importlib.import_module("transformers")  # untyped
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory / "weights" / "gpt2")
    return namespace


def _encoder() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        torch.nn.Linear(8, 1),
    )


async def _start_on_meta(policy: lampdist.FsdpPolicy) -> dict[str, torch.Tensor]:
    """An :func:`_encoder` built on the meta device, after one fsdp step of rate 0 on one
    rank: its starting values, whole."""
    with torch.device("meta"):
        module = _encoder()
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 3, 8, generator=generator), torch.randn(2, 3, 1, generator=generator))
    await lampdist.train(
        launch=lampdist.launch.LaunchEnv(rank=0, nranks=1),
        data=lampdist.ModelWithData(
            model=lampdist.SupervisedModel(module, torch.nn.functional.mse_loss),
            train_batches=lambda: [batch],
        ),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
        loop=lampdist.LoopOptions(max_epochs=1),
        step=lampdist.StepOptions(step_on="fsdp", fsdp=policy),
        stop_on_signals=False,
    )
    from torch.distributed.tensor import DTensor

    whole = {}
    for name, p in module.named_parameters():
        assert isinstance(p, DTensor), name  # sharded
        whole[name] = p.full_tensor().detach()
    return whole


async def then_big_models(namespace: dict[str, Any]) -> None:
    """What the page says of layers without ``reset_parameters()``: a TransformerEncoderLayer
    built on the meta device fails naming its attention, and with the page's ``policy`` it
    starts as torch builds it on a device (its zeros and ones where torch has them)."""
    with pytest.raises(lampdist.ConfigError, match=r"'0\.self_attn' \(MultiheadAttention\)"):
        await _start_on_meta(lampdist.FsdpPolicy())
    started = await _start_on_meta(namespace["policy"])
    built = {name: p.detach() for name, p in _encoder().named_parameters()}
    assert started.keys() == built.keys()
    for name, value in built.items():
        if value.numel() > 1 and bool((value == value.flatten()[0]).all()):  # LayerNorm's, ...
            assert torch.equal(started[name], value), name
        else:  # drawn at random (from other seeds than here)
            assert started[name].shape == value.shape, name
            assert bool(started[name].isfinite().all() and started[name].all()), name
    assert not bool(started["0.self_attn.out_proj.bias"].any())  # zeros, as torch leaves it


def _recovery_page(directory: Path) -> dict[str, Any]:
    """The root alone (a one-rank launch) with recovery: a snapshot after every window."""
    namespace = _shared(directory)
    namespace["__given__"]["steps_per_epoch"] = 2
    return namespace


class _TinyGpt(torch.nn.Module):
    """A stand-in for the ported script's GPT: ``forward(idx, targets) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits = self.head(self.embedding(idx))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _bring_your_model_page(_: Path) -> dict[str, Any]:
    """What the ported script defines itself: its model, text, batches and schedule, with a
    run of two epochs of two steps."""

    def get_batch_from(data: torch.Tensor, generator: torch.Generator) -> Any:
        ix = torch.randint(len(data) - 5, (3,), generator=generator).tolist()
        x = torch.stack([data[i : i + 4] for i in ix])
        y = torch.stack([data[i + 1 : i + 5] for i in ix])
        return x, y

    text = torch.randint(16, (200,), generator=torch.Generator().manual_seed(0))
    return {
        "GPT": lambda config: _TinyGpt(),
        "config": None,
        "train_data": text[:160],
        "val_data": text[160:],
        "get_batch_from": get_batch_from,
        "eval_interval": 2,
        "eval_iters": 2,
        "max_iters": 4,
        "log_interval": 1,
        "learning_rate": 0.01,
        "get_lr": lambda it: 0.01 * min(1.0, (it + 1) / 3),
    }


def _token_file(directory: Path) -> dict[str, Any]:
    """The tokenized text that the random-window sampler reads, and what it and the datasets
    table need."""
    tokens = torch.randint(16, (200,), generator=torch.Generator().manual_seed(0))
    (directory / "train.bin").write_bytes(tokens.to(torch.int16).numpy().tobytes())
    columns = {"x": torch.randn(8, 3).tolist(), "y": list(range(8))}
    return {"model": regression(), "block": 4, "batch_size": 2, "columns": columns}


def _given(*parts: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    def given(directory: Path) -> dict[str, Any]:
        namespace: dict[str, Any] = {}
        for part in parts:
            namespace |= part(directory)
        return namespace

    return given


PAGES: dict[str, Page] = {
    "README.md": Page(),  # a whole script: it defines its own data (my_shard)
    "docs/tutorial.md": Page(given=lambda _: {"ranks": classification_ranks()}),
    "docs/loop.md": Page(given=_loop_page, then=then_resume_loop),
    "docs/checkpoints.md": Page(given=_shared, then=then_main),
    "docs/clique.md": Page(
        given=lambda _: {"loss": torch.ones(2, requires_grad=True).sum()},
    ),
    "docs/control.md": Page(),
    "docs/howto-big-models.md": Page(given=_big_models_page, then=then_big_models),
    "docs/howto-bring-your-model.md": Page(given=_bring_your_model_page),
    "docs/howto-checkpoint-resume.md": Page(given=_given(_shared, _token_file)),
    "docs/howto-object-store.md": Page(
        given=_shared, then=then_object_store_main, s3_bucket="my-bucket"
    ),
    "docs/howto-metrics.md": Page(),
    "docs/howto-multinode.md": Page(given=_shared),
    "docs/howto-recovery.md": Page(given=_recovery_page),
    "docs/howto-service.md": Page(given=_service, then=_open_the_service),
    "docs/howto-tls-secrets.md": Page(given=_given(_shared, _tls_files)),
    "docs/howto-trackers.md": Page(given=_trackers_page, then=then_trackers),
    "docs/howto-uneven-data.md": Page(
        given=_given(
            _shared,
            lambda _: {
                "dataset": torch.utils.data.TensorDataset(torch.randn(50, 8), torch.randn(50, 1)),
                "module": torch.nn.Linear(8, 1),
                "loss_fn": torch.nn.functional.mse_loss,
                "PAD": 0,
            },
        )
    ),
    "docs/howto-slow-runs.md": Page(
        given=_given(
            _shared,
            lambda _: {"module": torch.nn.Linear(8, 1), "loss_fn": torch.nn.functional.mse_loss},
        )
    ),
    "docs/reliability.md": Page(given=_shared, then=then_root),
    "docs/threat-model.md": Page(given=_tls_files),
}


@pytest.fixture
def one_rank_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A scratch directory as the working directory, and torchrun's variables of one rank."""
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "LAMPDIST_SECRET": "docs-secret-docs-secret-docs-secret",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LAMPDIST_SECRET_FILE", raising=False)
    # docs/howto-trackers.md writes to an MLflow directory store, which MLflow 3 must allow
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checkpoint, "load_latest", _off_the_loop(checkpoint.load_latest))
    return tmp_path


def _off_the_loop(blocking: Callable[..., Any]) -> Callable[..., Any]:
    """``blocking``, refusing to run on an event loop's thread: the pages must show blocking
    calls made from async code in a worker thread, as the API reference asks."""

    def call(*args: Any, **kwargs: Any) -> Any:
        assert not on_event_loop_thread(), f"a page calls {blocking.__name__} on the event loop"
        return blocking(*args, **kwargs)

    return call


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_page_runs(page: str, one_rank_launch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = PAGES[page]
    with contextlib.ExitStack() as stack:
        if spec.s3_bucket is not None:
            server = start_server()
            stack.callback(server.kill)
            set_environment(monkeypatch, server)
            server.create_bucket(spec.s3_bucket)
        namespace: dict[str, Any] = {"__name__": "__main__"} | spec.given(one_rank_launch)
        found = blocks(page)
        assert found, f"{page} has no Python blocks"
        for index, code in enumerate(found):
            run_block(code, namespace, f"{page}[{index}]")
        if spec.then is not None:
            anyio.run(spec.then, namespace)


def test_every_page_with_python_is_run() -> None:
    pages = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT_DIR / "docs").glob("*.md")))]
    assert sorted(page for page in pages if blocks(page)) == sorted(PAGES)


# The resume snippet of docs/howto-checkpoint-resume.md, with every kind of schedule.


@attrs.frozen
class Seen:
    count: int = 0
    last_loss: float | None = None


@dataclasses.dataclass(frozen=True)
class SeenData:
    count: int = 0
    losses: tuple[float, ...] = ()


@attrs.frozen
class CountingSchedule:
    """A schedule whose factor depends on its state: a reset state changes the run."""

    kind: str

    @property
    def init(self) -> Any:
        if self.kind == "attrs":
            return Seen()
        if self.kind == "dataclass":
            return SeenData()
        return {"count": 0, "epochs": [], "note": "plain"}

    def learning_rate_factor(
        self, state: Any, epoch: int, last_validation_loss: float | None
    ) -> tuple[Any, float]:
        if isinstance(state, Seen):
            state = Seen(count=state.count + 1, last_loss=last_validation_loss)
        elif isinstance(state, SeenData):
            loss = () if last_validation_loss is None else (last_validation_loss,)
            state = SeenData(count=state.count + 1, losses=state.losses + loss)
        else:
            state = {**state, "count": state["count"] + 1, "epochs": [*state["epochs"], epoch]}
        count = state.count if not isinstance(state, dict) else state["count"]
        return state, 1.0 / count


def _never_improving() -> schedules.LearningRateSchedule[Any]:
    # every validation after the first counts as no improvement: the factor halves each
    # epoch from the resumed state, so a state that came back wrong changes the run
    return schedules.reduce_on_plateau(patience=1, threshold=10.0, relative_threshold_mode=False)


SCHEDULES: dict[str, Callable[[], schedules.LearningRateSchedule[Any]]] = {
    "noop": schedules.noop,
    "from_epoch_count": lambda: schedules.from_epoch_count(lambda epoch: 1.0 / (epoch + 1)),
    "decrement": lambda: schedules.decrement(every=1, factor=0.5),
    "step_after": lambda: schedules.step_after(steps=1, factor=0.5),
    "linear": lambda: schedules.linear(start=1.0, end=0.2, max_steps=4),
    "cyclic": lambda: schedules.cyclic(max_factor=2.0, period=4),
    "cosine": lambda: schedules.cosine(max_steps=8),
    "reduce_on_plateau": _never_improving,
    "warmup(reduce_on_plateau)": lambda: schedules.warmup(1, _never_improving(), start=0.5),
    "warmup(warmup(cosine))": lambda: schedules.warmup(1, schedules.warmup(1, schedules.cosine(8))),
    "user attrs state": lambda: CountingSchedule("attrs"),
    "user dataclass state": lambda: CountingSchedule("dataclass"),
    "user plain-JSON state": lambda: CountingSchedule("json"),
}


def _resume_snippet() -> str:
    (snippet,) = [code for code in blocks("docs/howto-checkpoint-resume.md") if "plateau" in code]
    return snippet


def _run_the_snippet(
    schedule: schedules.LearningRateSchedule[Any], max_epochs: int, run: Path
) -> tuple[lampdist.LoopState, dict[str, torch.Tensor]]:
    data = one_rank()
    final: list[lampdist.LoopState] = []

    async def train(**kwargs: Any) -> lampdist.LoopState | None:
        state = await lampdist.train(**kwargs)
        assert state is not None
        final.append(state)
        return state

    snippet = _resume_snippet().replace('"runs/plateau"', repr(str(run)))
    namespace: dict[str, Any] = {
        "anyio": anyio,
        "lampdist": type("Lampdist", (), {"LoopOptions": lampdist.LoopOptions, "train": train}),
        "__schedule__": schedule,
        "__max_epochs__": max_epochs,
        "__given__": {"data": data, "optimizer_factory": sgd},
    }
    run_block(
        snippet,
        namespace,
        "docs/howto-checkpoint-resume.md",
        learning_rate_schedule="__schedule__",
        max_epochs="__max_epochs__",
    )
    return final[0], {k: v.clone() for k, v in data.model.module.state_dict().items()}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_resume_snippet_continues_every_schedule_exactly(
    name: str, one_rank_launch: Path
) -> None:
    schedule = SCHEDULES[name]()
    whole, whole_weights = _run_the_snippet(schedule, 4, one_rank_launch / "whole")
    first, _ = _run_the_snippet(schedule, 2, one_rank_launch / "split")
    resumed, resumed_weights = _run_the_snippet(schedule, 4, one_rank_launch / "split")
    assert first.epoch == 2 and resumed.epoch == 4
    assert resumed.learning_curve == whole.learning_curve
    for key, value in whole_weights.items():
        assert torch.equal(resumed_weights[key], value), key


def test_the_schedules_states_matter() -> None:
    """Resuming from the initial state instead of the stored one changes each stateful
    schedule's factors: the test above would see a state that came back wrong."""
    for name in ("reduce_on_plateau", "warmup(reduce_on_plateau)", "user attrs state"):
        schedule = SCHEDULES[name]()
        state, losses = schedule.init, [1.0, 0.9, 0.8, 0.7]
        for epoch in range(2):
            state, _ = schedule.learning_rate_factor(state, epoch, losses[epoch])
        continued = schedule.learning_rate_factor(state, 2, losses[2])[1]
        restarted = schedule.learning_rate_factor(schedule.init, 2, losses[2])[1]
        assert continued != restarted, name
