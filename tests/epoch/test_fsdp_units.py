"""Which modules ``FsdpPolicy(shard_modules=...)`` makes units of, on one rank in this process
over a real Gloo group: types may nest (a block and the ``Linear`` layers inside it), since
FSDP2 needs a module's inner units sharded before it, and the run trains as with the root
module alone as the unit."""

from __future__ import annotations

import anyio
import pytest
import torch

import lampdist
from lampdist.launch import LaunchEnv

pytestmark = pytest.mark.skipif(
    not hasattr(torch.distributed, "init_process_group"), reason="torch without distributed"
)


class Block(torch.nn.Module):
    """A residual block of two ``Linear`` layers."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 12, dtype=torch.float64)
        self.down = torch.nn.Linear(12, 6, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return x + inner


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(6, 1, dtype=torch.float64))


def trained(policy: lampdist.FsdpPolicy) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The whole weights after two epochs of one rank under fsdp with ``policy``, and the
    classes of its units (FSDP2's ``FSDP<name>``), inner ones first."""
    from torch.distributed.fsdp import FSDPModule

    module = model()
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 6, generator=generator, dtype=torch.float64),)
        + (torch.randn(8, 1, generator=generator, dtype=torch.float64),)
        for _ in range(3)
    ]

    async def run() -> None:
        await lampdist.train(
            launch=LaunchEnv(rank=0, nranks=1),
            data=lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, torch.nn.functional.mse_loss),
                train_batches=lambda: batches,
                validation_batches=lambda: batches[:1],
            ),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            loop=lampdist.LoopOptions(max_epochs=2),
            step=lampdist.StepOptions(step_on="fsdp", fsdp=policy),
            stop_on_signals=False,
        )

    anyio.run(run)
    weights = {
        name: value.full_tensor() if hasattr(value, "full_tensor") else value
        for name, value in module.state_dict().items()
    }
    units = [type(unit).__name__ for unit in module.modules() if isinstance(unit, FSDPModule)]
    return weights, units


def test_nested_unit_types_shard_the_inner_units_first_and_train_as_one_unit() -> None:
    nested, units = trained(lampdist.FsdpPolicy(shard_modules=(Block, torch.nn.Linear)))
    assert sorted(units) == sorted(["FSDPSequential"] + ["FSDPBlock"] * 2 + ["FSDPLinear"] * 5)
    whole, root_only = trained(lampdist.FsdpPolicy())
    assert root_only == ["FSDPSequential"]
    assert nested.keys() == whole.keys()
    for name, value in nested.items():
        torch.testing.assert_close(value, whole[name], rtol=0, atol=1e-12, msg=name)
