"""One rank's own part of a run's state: what it needs to go on exactly where it stopped.

Every rank captures its :class:`RankState` at a checkpoint (the root gathers them, see
:meth:`StepKernel.checkpoint_parts`) and takes its own back when a run resumes or recovers
(:meth:`PassRunner.resume_ranks`). Its stored form, :meth:`RankState.to_plain`, is what a
checkpoint's ``rank_states`` holds per rank.

Adding a piece of a rank's own state is a field here, its line in :meth:`capture`,
:meth:`to_plain` and :meth:`from_plain`, and where :meth:`restore` puts it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .._checkpoint import RngStates, capture_rng_states, restore_rng_states
from ._stream import StreamPosition

__all__ = ["RankState"]


@attrs.frozen
class RankState:
    """A rank's place in its training data (``None`` without ``steps_per_epoch``) and its
    global RNG states; within a pass run as segments, the pass's running sums so far
    (``carried``, see ``_segments``; ``None`` between passes)."""

    position: StreamPosition | None
    rng: RngStates
    carried: dict[str, Any] | None = None

    @classmethod
    def capture(
        cls, position: StreamPosition | None, carried: dict[str, Any] | None = None
    ) -> RankState:
        """This rank's state now (on its compute thread), at data ``position``."""
        return cls(position=position, rng=capture_rng_states(), carried=carried)

    def to_plain(self) -> dict[str, Any]:
        """The stored form: plain values and the RNG's tensors."""
        plain = {
            "position": None if self.position is None else self.position.to_plain(),
            "rng_tensors": self.rng.tensors(),
            "rng_json": self.rng.to_json(),
        }
        if self.carried is not None:
            plain["carried"] = self.carried
        return plain

    @classmethod
    def from_plain(cls, stored: Mapping[str, Any]) -> RankState:
        """Back from :meth:`to_plain`'s form."""
        position = stored["position"]
        return cls(
            position=None if position is None else StreamPosition.from_plain(position),
            rng=RngStates.from_stored(stored["rng_tensors"], stored["rng_json"]),
            carried=stored.get("carried"),
        )

    def restore_rng(self) -> None:
        """Put this rank's RNG states back (the process's global generators)."""
        restore_rng_states(self.rng)
