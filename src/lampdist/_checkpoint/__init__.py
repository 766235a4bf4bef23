"""The machinery behind :mod:`lampdist.checkpoint`: format, files, RNG, writer, reader."""

from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._read import read_latest as read_latest
from ._rng import RngStates as RngStates
from ._rng import capture_rng_states as capture_rng_states
from ._rng import restore_rng_states as restore_rng_states
from ._write import check_writable as check_writable
from ._write import write_checkpoint as write_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "RngStates",
    "capture_rng_states",
    "check_writable",
    "read_latest",
    "restore_rng_states",
    "write_checkpoint",
]
