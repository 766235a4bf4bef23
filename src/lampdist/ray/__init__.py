"""Run lampdist on Ray: as the launch target (:func:`run`: one actor per rank in a placement
group, a lost follower started again by Ray and taken back in by :class:`lampdist.Recovery`,
a lost root starting the job again from its newest checkpoint), or inside Ray Train's
``TorchTrainer`` (:func:`from_train_context`).

::

    import lampdist, lampdist.ray

    async def main(env: lampdist.launch.LaunchEnv) -> lampdist.LoopState:
        return await lampdist.train(..., launch=env)

    states = lampdist.ray.run_sync(main, nranks=4, gpus_per_rank=1)

Ray is imported only when a function here is called (``pip install 'lampdist[ray]'``);
``import lampdist`` never imports this package. See docs/howto-ray.md and
docs/howto-ray-train.md.
"""

from __future__ import annotations

from ._actor import RunContext as RunContext
from ._actor import run_context as run_context
from ._engine import run as run
from ._engine import run_sync as run_sync
from ._train import TrainSecret as TrainSecret
from ._train import from_train_context as from_train_context
from ._train import report as report
from ._train import resume as resume
from ._train import storage_dir as storage_dir

__all__ = [
    "RunContext",
    "TrainSecret",
    "from_train_context",
    "report",
    "resume",
    "run",
    "run_context",
    "run_sync",
    "storage_dir",
]
