"""What a ``step_on="fsdp"`` run tells its user. No warning that lampdist itself causes:
FSDP2's "returned a view tensor" warning about the root module, whose output goes to
lampdist, is silenced; the same warning about an inner unit, whose output goes on into the
model's own code, is not. And the log line of the sharding counts in good English."""

from __future__ import annotations

import copy
import logging
import warnings

import anyio
import pytest
import torch

import lampdist
from lampdist.launch import LaunchEnv

pytestmark = pytest.mark.skipif(
    not hasattr(torch.distributed, "init_process_group"), reason="torch without distributed"
)

VIEW = "returned a view tensor"


def sequence_model() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A model whose output is a view (a ``Linear`` on a batch of sequences) and a batch."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 5, 8, generator=generator), torch.randn(4, 5, 1, generator=generator))
    return module, batch


def view_warnings(policy: lampdist.FsdpPolicy) -> list[str]:
    """The "returned a view tensor" warnings of a run of one rank in this process, every one
    shown (none hidden by an earlier run's "once per place")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_one_rank(policy)
    return [str(warning.message) for warning in caught if VIEW in str(warning.message)]


def run_one_rank(policy: lampdist.FsdpPolicy) -> None:
    """One epoch of :func:`sequence_model` under fsdp, on one rank in this process."""
    module, batch = sequence_model()
    assert copy.deepcopy(module)(batch[0])._base is not None  # the view tests can fail

    async def run() -> None:
        await lampdist.train(
            launch=LaunchEnv(rank=0, nranks=1),
            data=lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, torch.nn.functional.mse_loss),
                train_batches=lambda: [batch, batch],
                validation_batches=lambda: [batch],
            ),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            loop=lampdist.LoopOptions(max_epochs=1),
            step=lampdist.StepOptions(step_on="fsdp", fsdp=policy),
            stop_on_signals=False,
        )

    anyio.run(run)


def test_an_fsdp_run_emits_no_warning_of_the_view_its_root_module_returns() -> None:
    assert view_warnings(lampdist.FsdpPolicy()) == []


def test_the_warning_of_an_inner_unit_stays() -> None:
    seen = view_warnings(lampdist.FsdpPolicy(shard_modules=(torch.nn.Linear,)))
    assert seen  # the last Linear, a unit of its own, returns a view to Sequential's code
    assert all(message.startswith(f"FSDP2-wrapped module (FSDPLinear) {VIEW}") for message in seen)


def test_the_sharding_is_logged_with_its_counts_in_the_singular(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="lampdist"):
        run_one_rank(lampdist.FsdpPolicy())
    assert any(
        record.getMessage().startswith("fsdp over 1 rank: 1 sharded module, precision ")
        for record in caplog.records
    ), [record.getMessage() for record in caplog.records]
