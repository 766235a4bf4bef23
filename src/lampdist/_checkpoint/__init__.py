"""The machinery behind :mod:`lampdist.checkpoint`: format, files, RNG, the storages,
writers, readers (a local directory, an object store), the inventory."""

from ._background import StageOn as StageOn
from ._background import background_writes as background_writes
from ._export import FORMATS as FORMATS
from ._export import ExportFormat as ExportFormat
from ._export import sharded_weights as sharded_weights
from ._export import whole_weights as whole_weights
from ._export import write_weights as write_weights
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import FileRecord as FileRecord
from ._hf_export import hf_model as hf_model
from ._hf_export import write_hf as write_hf
from ._inventory import Listed as Listed
from ._inventory import list_checkpoints as list_checkpoints
from ._object_store import check_store_writable as check_store_writable
from ._object_store import is_url as is_url
from ._object_store import local_shards as local_shards
from ._object_store import new_store_shards as new_store_shards
from ._object_store import read_latest_from_store as read_latest_from_store
from ._object_store import upload_rank_shards as upload_rank_shards
from ._object_store import write_to_store as write_to_store
from ._read import Loaded as Loaded
from ._read import read_latest as read_latest
from ._rng import RngStates as RngStates
from ._rng import capture_rng_states as capture_rng_states
from ._rng import restore_rng_states as restore_rng_states
from ._select import read_chosen as read_chosen
from ._select import read_location as read_location
from ._shards import SHARDS as SHARDS
from ._shards import ShardedState as ShardedState
from ._shards import by_index as by_index
from ._shards import by_name as by_name
from ._shards import load_rank_shards as load_rank_shards
from ._shards import read_whole as read_whole
from ._shards import write_rank_shards as write_rank_shards
from ._storage import WRITE_TIMEOUT as WRITE_TIMEOUT
from ._storage import DirectoryStorage as DirectoryStorage
from ._storage import EffectStorage as EffectStorage
from ._storage import FileStorage as FileStorage
from ._storage import Saver as Saver
from ._storage import Storage as Storage
from ._storage import UrlStorage as UrlStorage
from ._storage import check_storage_options as check_storage_options
from ._storage import storage_for as storage_for
from ._storage import write_own_shards as write_own_shards
from ._write import check_writable as check_writable
from ._write import new_shards_directory as new_shards_directory
from ._write import write_checkpoint as write_checkpoint

__all__ = [
    "FORMATS",
    "FORMAT_VERSION",
    "SHARDS",
    "WRITE_TIMEOUT",
    "DirectoryStorage",
    "EffectStorage",
    "ExportFormat",
    "FileRecord",
    "FileStorage",
    "Listed",
    "Loaded",
    "RngStates",
    "Saver",
    "ShardedState",
    "StageOn",
    "Storage",
    "UrlStorage",
    "background_writes",
    "by_index",
    "by_name",
    "capture_rng_states",
    "check_storage_options",
    "check_store_writable",
    "check_writable",
    "hf_model",
    "is_url",
    "list_checkpoints",
    "load_rank_shards",
    "local_shards",
    "new_shards_directory",
    "new_store_shards",
    "read_chosen",
    "read_latest",
    "read_latest_from_store",
    "read_location",
    "read_whole",
    "restore_rng_states",
    "sharded_weights",
    "storage_for",
    "upload_rank_shards",
    "whole_weights",
    "write_checkpoint",
    "write_hf",
    "write_own_shards",
    "write_rank_shards",
    "write_to_store",
    "write_weights",
]
