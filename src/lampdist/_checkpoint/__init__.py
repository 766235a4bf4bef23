"""The machinery behind :mod:`lampdist.checkpoint`: format, files, RNG, writer, reader."""

from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import FileRecord as FileRecord
from ._read import read_latest as read_latest
from ._rng import RngStates as RngStates
from ._rng import capture_rng_states as capture_rng_states
from ._rng import restore_rng_states as restore_rng_states
from ._shards import SHARDS as SHARDS
from ._shards import ShardedState as ShardedState
from ._shards import by_index as by_index
from ._shards import by_name as by_name
from ._shards import load_rank_shards as load_rank_shards
from ._shards import read_whole as read_whole
from ._shards import write_rank_shards as write_rank_shards
from ._write import check_writable as check_writable
from ._write import new_shards_directory as new_shards_directory
from ._write import write_checkpoint as write_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "SHARDS",
    "FileRecord",
    "RngStates",
    "ShardedState",
    "by_index",
    "by_name",
    "capture_rng_states",
    "check_writable",
    "load_rank_shards",
    "new_shards_directory",
    "read_latest",
    "read_whole",
    "restore_rng_states",
    "write_checkpoint",
    "write_rank_shards",
]
