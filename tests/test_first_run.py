"""The first run in a process imports nothing heavy once it has started: what it needs is
imported by the entry point's preload, in a worker thread, before the run waits on a peer
(a heavy import holds the GIL for 100-200 ms at a stretch, which stalls the event loop).
``import lampdist``, all of its names resolved, imports none of it. A fresh interpreter for
each case."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.fx", "sympy", "torch._functorch")

FIRST_RUN = textwrap.dedent(
    """
    import copy, sys, threading
    import anyio, attrs, torch
    import lampdist
    import lampdist._preload

    preloaded = []  # (the modules by the preload's end, whether it ran on the loop's thread)
    import_modules = lampdist._preload._import_modules

    def recorded():
        import_modules()
        preloaded.append((set(sys.modules), threading.current_thread() is loop_thread))

    lampdist._preload._import_modules = recorded

    def source():
        return [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]

    async def main():
        global loop_thread
        loop_thread = threading.current_thread()
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
        assert len(preloaded) == 1, f"the preload ran {len(preloaded)} times"
        modules, on_loop = preloaded[0]
        print("on the loop's thread:", on_loop)
        print("in the preload:", *sorted(modules - before))
        print("after the preload:", *sorted(set(sys.modules) - modules))

    anyio.run(main)
    """
)


def _heavy(names: list[str]) -> list[str]:
    return [name for name in names if name.startswith(HEAVY)]


def test_a_first_run_imports_nothing_heavy_after_its_preload() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_RUN], capture_output=True, text=True, timeout=300, check=True
    )
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines())
    assert lines["on the loop's thread"].split() == ["False"]
    assert "torch._dynamo" in lines["in the preload"].split()  # and so not before it
    heavy = _heavy(lines["after the preload"].split())
    assert heavy == [], f"imported during the first run, after its preload: {heavy}"


def test_import_lampdist_imports_nothing_heavy() -> None:
    """Every public name resolved, the whole library: nothing heavy beyond ``import torch``'s
    own imports (torch._dynamo above all)."""
    script = (
        "import sys, torch\n"
        "torch_modules = set(sys.modules)\n"
        "import lampdist\n"
        "for name in lampdist.__all__: getattr(lampdist, name)\n"
        "print(*sorted(set(sys.modules) - torch_modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    imported = done.stdout.split()
    assert "lampdist._roles._rank" in imported
    assert _heavy(imported) == []
