"""``LossModel``: a model that computes its own loss from dict batches trains exactly like one
process on the concatenated batches, its loss weighted by what it averages over (tokens with
``-100`` labels, uneven from batch to batch), on 1 to 3 ranks with accumulation; with
``mean_over="examples"`` it reproduces ``SupervisedModel`` bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lampdist

from . import lm_reference as lm
from ._launch import launch_ranks
from .reference import make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def listed(batches: Sequence[Any]) -> lampdist.BatchSource:
    return lambda: list(batches)


async def train_locally(
    models: Sequence[Any],
    train: Sequence[Sequence[Any]],
    valid: Sequence[Sequence[Any]] | None,
    *,
    step_on: str = "root",
    accumulate: int = lm.ACCUMULATE,
    epochs: int = lm.EPOCHS,
    optimizer_factory: Any = lm.sgd,
    on_event: Any = None,
) -> lampdist.LoopState:
    with anyio.fail_after(60):
        return await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=model,
                    train_batches=listed(train[rank]),
                    validation_batches=None if valid is None else listed(valid[rank]),
                )
                for rank, model in enumerate(models)
            ],
            optimizer_factory=optimizer_factory,
            loop=lampdist.LoopOptions(max_epochs=epochs, on_event=on_event),
            step=lampdist.StepOptions(
                accumulate_gradient_over_n_batches=accumulate,
                step_on=step_on,  # type: ignore[arg-type]
            ),
        )


def assert_weights(module: torch.nn.Module, expected: torch.nn.Module) -> None:
    for (name, got), want in zip(
        module.state_dict().items(), expected.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=name)


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
@pytest.mark.parametrize("nranks", [1, 2, 3])
async def test_a_token_mean_loss_trains_like_one_process_on_the_concatenated_batches(
    nranks: int, step_on: str
) -> None:
    train = lm.make_shards(lm.TRAIN_SIZES[nranks], seed=1)
    valid = lm.make_shards(lm.VALID_SIZES[nranks], seed=2)
    tokens = [lm.count_labels(b) for shard in train for b in shard]
    assert len(set(tokens)) > 3  # the token counts differ from batch to batch
    expected, train_losses, valid_losses = lm.reference_training(lm.TinyLM(0), lm.sgd, train, valid)
    modules = [lm.TinyLM(seed=0 if rank == 0 else 10 + rank) for rank in range(nranks)]
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.done:
            events.append(event)

    state = await train_locally(
        [lm.lm_model(m) for m in modules], train, valid, step_on=step_on, on_event=on_event
    )
    for module in modules:
        assert_weights(module, expected)
    assert [p.training_loss for p in state.learning_curve] == pytest.approx(train_losses, rel=1e-9)
    assert [p.validation_loss for p in state.learning_curve] == pytest.approx(
        valid_losses, rel=1e-9
    )
    # The events count examples, not the tokens that weight the losses.
    examples = sum(len(b["input_ids"]) for shard in train for b in shard)
    valid_examples = sum(len(b["input_ids"]) for shard in valid for b in shard)
    assert [e.examples for e in events if e.kind == "train"] == [examples] * lm.EPOCHS
    assert [e.examples for e in events if e.kind == "valid"] == [valid_examples] * lm.EPOCHS
    assert [e.tokens for e in events if e.kind == "train"] == [sum(tokens)] * lm.EPOCHS


async def test_a_supervised_model_weights_by_its_token_count_with_mean_over_tokens() -> None:
    """SupervisedModel over (input_ids, labels) pairs, its loss a token mean: the same
    exactness, the weight coming from ``token_count`` of the target."""
    train = lm.make_shards(lm.TRAIN_SIZES[2], seed=1)
    valid = lm.make_shards(lm.VALID_SIZES[2], seed=2)
    expected, train_losses, valid_losses = lm.reference_training(lm.TinyLM(0), lm.sgd, train, valid)

    def loss_fn(output: lm.Output, labels: torch.Tensor) -> torch.Tensor:
        logits = output.logits[:, :-1].reshape(-1, lm.VOCAB)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))

    def pairs(shards: list[list[lm.Batch]]) -> list[list[Any]]:
        return [[(b["input_ids"], b["labels"]) for b in shard] for shard in shards]

    modules = [lm.TinyLM(0), lm.TinyLM(11)]
    models = [
        lampdist.SupervisedModel(
            m,
            loss_fn,
            token_count=lambda labels: int((labels[:, 1:] != -100).sum()),
            mean_over="tokens",
        )
        for m in modules
    ]
    state = await train_locally(models, pairs(train), pairs(valid), step_on="every_rank")
    for module in modules:
        assert_weights(module, expected)
    assert [p.training_loss for p in state.learning_curve] == pytest.approx(train_losses, rel=1e-9)
    assert [p.validation_loss for p in state.learning_curve] == pytest.approx(
        valid_losses, rel=1e-9
    )


async def test_weighting_a_token_mean_loss_by_examples_differs_from_one_process() -> None:
    """The bug ``mean_over="tokens"`` avoids: the same run weighted by examples is off."""
    train = lm.make_shards(lm.TRAIN_SIZES[2], seed=1)
    valid = lm.make_shards(lm.VALID_SIZES[2], seed=2)
    expected, _, _ = lm.reference_training(lm.TinyLM(0), lm.sgd, train, valid)
    modules = [lm.TinyLM(0), lm.TinyLM(11)]
    await train_locally([lm.lm_model(m, "examples") for m in modules], train, valid)
    got = modules[0].state_dict()["head.weight"]
    assert (got - expected.state_dict()["head.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
async def test_mean_over_examples_reproduces_supervised_model_bit_for_bit(step_on: str) -> None:
    """A LossModel over the (inputs, target) batches of SupervisedModel's exactness tests,
    with the default example count, gives the very same weights and losses."""
    sizes = [[5, 7, 3, 9, 2], [6, 6, 0, 4], [4, 0, 8]]
    train = make_shards(sizes, seed=1)
    valid = make_shards([[5, 3], [4], [2, 2]], seed=2)
    runs = []
    for kind in ("supervised", "loss"):
        modules = [make_model(seed=0 if rank == 0 else 10 + rank) for rank in range(3)]
        models: list[Any] = [
            lampdist.SupervisedModel(m, mse)
            if kind == "supervised"
            else lampdist.LossModel(m, lambda module, batch: mse(module(batch[0]), batch[1]))
            for m in modules
        ]
        state = await train_locally(models, train, valid, step_on=step_on, optimizer_factory=_adamw)
        runs.append((modules[0].state_dict(), state.learning_curve))
    (weights, curve), (loss_weights, loss_curve) = runs
    for name, value in weights.items():
        assert torch.equal(loss_weights[name], value), name
    assert [(p.training_loss, p.validation_loss) for p in curve] == [
        (p.training_loss, p.validation_loss) for p in loss_curve
    ]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


async def test_metrics_see_the_output_the_loss_returned_and_the_batch() -> None:
    """A Metric of a LossModel gets ``(output, batch)``: the token accuracy over uneven
    shards equals one process's on the concatenated batches."""
    train = lm.make_shards(lm.TRAIN_SIZES[2], seed=1)
    valid = lm.make_shards(lm.VALID_SIZES[2], seed=2)

    def accuracy(logits: torch.Tensor, batch: lm.Batch) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["labels"][:, 1:]
        kept = labels != -100
        right = (logits[:, :-1].argmax(-1) == labels) & kept
        return right.sum(), kept.sum()

    metric = lampdist.Metric(accuracy)
    modules = [lm.TinyLM(0), lm.TinyLM(11)]
    models = [
        lampdist.LossModel(
            m,
            lm.lm_loss_and_output,
            tokens=lm.count_labels,
            mean_over="tokens",
            metrics={"accuracy": metric},
        )
        for m in modules
    ]
    state = await train_locally(models, train, valid, epochs=1)
    joined = {
        key: torch.cat([b[key] for shard in valid for b in shard])
        for key in ("input_ids", "labels")
    }
    with torch.no_grad():
        right, kept = accuracy(modules[0].eval()(joined["input_ids"]).logits, joined)
    point = state.learning_curve[0]
    assert point.metrics["validation_accuracy"] == pytest.approx(int(right) / int(kept), rel=1e-12)
    assert 0.0 <= point.metrics["training_accuracy"] <= 1.0  # type: ignore[operator]


async def run_one_rank(model: Any, batches: Sequence[Any], *, with_valid: bool = False) -> Any:
    return await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=model,
                train_batches=listed(batches),
                validation_batches=listed(batches) if with_valid else None,
            )
        ],
        optimizer_factory=lm.sgd,
        loop=lampdist.LoopOptions(max_epochs=1),
    )


def _two_ranks(model: Any, other: Any, batches: Sequence[Any]) -> Any:
    return lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(model=m, train_batches=listed(batches)) for m in (model, other)
        ],
        optimizer_factory=lm.sgd,
        loop=lampdist.LoopOptions(max_epochs=1),
    )


BATCHES = lm.make_shards([[3, 2]], seed=5)[0]


@pytest.mark.parametrize(
    ("loss", "match"),
    [
        (lambda m, b: m(**b), r"must return a scalar tensor .* or \(loss, output\), got Output"),
        (
            lambda m, b: torch.stack([m(**b).loss] * 2),
            r"must return a scalar tensor .* got a tensor of shape \(2,\)",
        ),
        (lambda m, b: (m(**b).loss, 1, 2), r"got a tuple of length 3"),
    ],
    ids=["output-object", "vector", "triple"],
)
async def test_a_bad_loss_return_value_is_a_bad_batch_naming_rank_phase_and_batch(
    loss: Any, match: str
) -> None:
    with pytest.raises(lampdist.BadBatch, match=match) as caught:
        await run_one_rank(lampdist.LossModel(lm.TinyLM(), loss), BATCHES)
    error = caught.value
    assert (error.rank, error.phase) == (0, "train")
    assert "epoch 0, batch 0" in str(error) and "'input_ids': int64[3, 6]" in str(error)


async def test_metrics_need_the_loss_to_return_its_output() -> None:
    model = lampdist.LossModel(
        lm.TinyLM(), lm.lm_loss, metrics={"m": lampdist.Metric(lambda out, b: (out.sum(), 1))}
    )
    with pytest.raises(lampdist.BadBatch, match=r"model has metrics.*return \(loss, output\)"):
        await run_one_rank(model, BATCHES)


async def test_unknown_tokens_with_mean_over_tokens_are_a_bad_batch() -> None:
    model = lampdist.LossModel(
        lm.TinyLM(), lm.lm_loss, tokens=lambda batch: None, mean_over="tokens"
    )
    with pytest.raises(lampdist.BadBatch, match=r"mean_over='tokens'.*pass tokens=") as caught:
        await run_one_rank(model, BATCHES)
    assert (caught.value.rank, caught.value.phase) == (0, "train")
    # No integer tensor of two dimensions: the default count cannot say either.
    floats = [{"x": torch.zeros(2, 3, dtype=torch.float64)}]
    model = lampdist.LossModel(
        torch.nn.Linear(3, 1).double(), lambda m, b: m(b["x"]).mean(), mean_over="tokens"
    )
    with pytest.raises(lampdist.BadBatch, match="did not say"):
        await run_one_rank(model, floats)


async def test_bad_counts_are_a_bad_batch() -> None:
    model = lampdist.LossModel(lm.TinyLM(), lm.lm_loss, examples=lambda batch: -1)
    with pytest.raises(lampdist.BadBatch, match=r"LossModel.examples must return an int >= 0"):
        await run_one_rank(model, BATCHES)
    model = lampdist.LossModel(lm.TinyLM(), lm.lm_loss)
    with pytest.raises(lampdist.BadBatch, match="holds no tensor"):
        await run_one_rank(model, [{"a": 1}])


@pytest.mark.parametrize("make", [lampdist.LossModel, lampdist.SupervisedModel])
def test_a_bad_mean_over_is_a_config_error(make: Any) -> None:
    with pytest.raises(lampdist.ConfigError, match=r"mean_over must be 'examples' or 'tokens'"):
        make(lm.TinyLM(), lm.lm_loss, mean_over="token")


async def test_ranks_that_weight_by_other_counts_are_refused() -> None:
    with pytest.raises(lampdist.MismatchError, match="mean_over"):
        await _two_ranks(lm.lm_model(lm.TinyLM()), lm.lm_model(lm.TinyLM(), "examples"), BATCHES)


async def test_a_model_error_describes_a_dict_batch() -> None:
    def failing(module: torch.nn.Module, batch: lm.Batch) -> torch.Tensor:
        raise ValueError("no")

    with pytest.raises(lampdist.TrainingError, match=r"batch \{'input_ids': int64\[3, 6\]"):
        await run_one_rank(lampdist.LossModel(lm.TinyLM(), failing), BATCHES)


async def test_flops_are_counted_for_a_loss_model() -> None:
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        events.append(event)

    model = lm.lm_model(lm.TinyLM(), flops_per_example="count")
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(model=model, train_batches=listed(BATCHES))
        ],
        optimizer_factory=lm.sgd,
        loop=lampdist.LoopOptions(max_epochs=1, on_event=on_event),
    )
    assert events[-1].flops_per_example is not None and events[-1].flops_per_example > 0


def test_batches_of_attrs_instances_are_counted_and_moved() -> None:
    import attrs

    @attrs.frozen
    class Pair:
        ids: torch.Tensor
        weight: float

    model = lampdist.LossModel(lm.TinyLM(), lm.lm_loss)
    data, examples, tokens, weight = model.load(
        Pair(torch.zeros(4, 6, dtype=torch.long), 0.5), torch.device("cpu")
    )
    assert (examples, tokens, weight) == (4, 24, 4)
    assert isinstance(data, Pair) and data.weight == 0.5


# -- several processes over TCP ---------------------------------------------------------------


def launch(out: Path, nranks: int, *extra: str) -> None:
    """Every rank of :mod:`.lm_rank` to its end; each must exit 0."""
    for rank, (code, stderr) in enumerate(launch_ranks("lm_rank", out, nranks, *extra)):
        assert code == 0, f"rank {rank}: {stderr}"


@pytest.mark.parametrize(
    ("nranks", "step_on"), [(3, "root"), (2, "every_rank"), (3, "fsdp")], ids=str
)
def test_processes_over_tcp_train_a_token_mean_loss_like_one_process(
    tmp_path: Path, nranks: int, step_on: str
) -> None:
    import json

    launch(tmp_path, nranks, "--step-on", step_on)
    train = lm.make_shards(lm.TRAIN_SIZES[nranks], seed=1)
    valid = lm.make_shards(lm.VALID_SIZES[nranks], seed=2)
    expected, train_losses, valid_losses = lm.reference_training(lm.TinyLM(0), lm.sgd, train, valid)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(nranks)]
    for name, want in expected.state_dict().items():
        if step_on == "fsdp":  # each rank's shard, in rank order along dimension 0
            got = torch.cat([part[name] for part in parts])
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=name)
        else:
            for part in parts:
                torch.testing.assert_close(part[name], want, rtol=0, atol=1e-9, msg=name)
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert [c[0] for c in curve] == pytest.approx(train_losses, rel=1e-9)
    assert [c[1] for c in curve] == pytest.approx(valid_losses, rel=1e-9)
