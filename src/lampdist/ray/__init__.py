"""Run lampdist on a Ray cluster: one actor per rank in a placement group, a lost follower
started again by Ray and taken back in by :class:`lampdist.Recovery`, a lost root starting
the job again from its newest checkpoint.

::

    import lampdist, lampdist.ray

    async def main(env: lampdist.launch.LaunchEnv) -> lampdist.LoopState:
        return await lampdist.train(..., launch=env)

    states = lampdist.ray.run_sync(main, nranks=4, gpus_per_rank=1)

Ray is imported when :func:`run` is called (``pip install 'lampdist[ray]'``); ``import
lampdist`` never imports this package. See docs/howto-ray.md.
"""

from __future__ import annotations

from ._actor import RunContext as RunContext
from ._actor import run_context as run_context
from ._engine import run as run
from ._engine import run_sync as run_sync

__all__ = ["RunContext", "run", "run_context", "run_sync"]
