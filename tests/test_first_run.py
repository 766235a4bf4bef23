"""The first run in a process imports nothing heavy while the host's event loop runs: what it
needs comes with ``import lampdist`` (a run's imports hold the GIL for up to 150 ms at a
stretch, which stalls the loop). A fresh interpreter for each case."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import copy, sys
    import anyio, attrs, torch
    import lampdist

    def source():
        return [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]

    async def main():
        before = set(sys.modules)
        model = lampdist.SupervisedModel(torch.nn.Linear(4, 1), torch.nn.functional.mse_loss)
        entry = lampdist.ModelWithData(
            model=model, train_batches=source, validation_batches=source
        )
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[entry, attrs.evolve(entry, model=copy.deepcopy(model))],
            optimizer_factory=lambda params: torch.optim.AdamW(params, lr=0.01),
            loop=lampdist.LoopOptions(max_epochs=2),
        )
        print("\\n".join(sorted(set(sys.modules) - before)))

    anyio.run(main)
    """
)

HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.fx", "sympy", "torch._functorch")


def test_a_first_run_imports_nothing_heavy() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    imported = done.stdout.split()
    heavy = [name for name in imported if name.startswith(HEAVY)]
    assert heavy == [], f"imported during the first run: {heavy}"
