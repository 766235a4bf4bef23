"""The machinery behind :mod:`lampdist.checkpoint`: format, files, RNG, writer, reader."""

from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._read import read_latest as read_latest
from ._rng import capture_rng_states as capture_rng_states
from ._rng import restore_rng_states as restore_rng_states
from ._schedule_state import rebuild_schedule_state as rebuild_schedule_state
from ._schedule_state import schedule_state_from_json as schedule_state_from_json
from ._write import NO_SCHEDULE as NO_SCHEDULE
from ._write import write_checkpoint as write_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "NO_SCHEDULE",
    "capture_rng_states",
    "read_latest",
    "rebuild_schedule_state",
    "restore_rng_states",
    "schedule_state_from_json",
    "write_checkpoint",
]
