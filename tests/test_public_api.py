"""Each public module's ``__all__`` is honest: every name exists and is documented."""

from __future__ import annotations

import enum
import importlib
import inspect
import pathlib
import pickle
import pkgutil
import types
import typing
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

import lampdist

# The public line: these names, and nothing else, are lampdist's API. A change here is an
# API change (CHANGELOG); everything else is private and may change without notice.
PUBLIC_NAMES = {
    "lampdist": [
        "AuthenticationError",
        "BadBatch",
        "BatchSource",
        "CheckpointError",
        "CheckpointLoopState",
        "CheckpointState",
        "CheckpointVersionError",
        "Clique",
        "CliqueError",
        "CliqueTimeout",
        "CollectiveFailed",
        "ConfigError",
        "ControlError",
        "CurvePoint",
        "EarlyStopping",
        "EarlyStoppingState",
        "Evaluation",
        "FsdpPolicy",
        "Interrupted",
        "JoinRejected",
        "JoinTimeout",
        "LampdistError",
        "LampdistTimeout",
        "LoopOptions",
        "LoopState",
        "LossModel",
        "Metric",
        "MismatchError",
        "ModelWithData",
        "Monitor",
        "NonFiniteLoss",
        "OnPassEvent",
        "OptimizerFactory",
        "PassAwareBatchSource",
        "PassContext",
        "PassEvent",
        "PeerDisconnected",
        "PeerUnresponsive",
        "Precision",
        "ProtocolError",
        "RandomBatches",
        "RankFailed",
        "Recovered",
        "Recovery",
        "Resumed",
        "SaveBestModel",
        "StepOptions",
        "StepSplit",
        "StoredWeights",
        "SupervisedModel",
        "Timeouts",
        "TrainEpoch",
        "TrainingError",
        "TrainingState",
        "ValidationEpoch",
        "checkpoint",
        "control",
        "drive_distributed_training",
        "epochs",
        "evaluate",
        "evaluate_locally",
        "follow_distributed_training",
        "from_safetensors",
        "launch",
        "local_data_parallel_training_loop",
        "open_clique",
        "run_until_signal",
        "schedules",
        "trackers",
        "train",
    ],
    "lampdist.checkpoint": [
        "FORMAT_VERSION",
        "Resumed",
        "consolidate",
        "export",
        "export_hf",
        "load",
        "load_latest",
        "to_directory",
        "to_url",
    ],
    "lampdist.clique": [
        "Clique",
        "CliqueFactory",
        "CliqueId",
        "InProcess",
        "PendingCollective",
        "ProcessGroups",
        "in_process",
        "open_clique",
        "serve_rendezvous",
    ],
    "lampdist.control": [
        "Command",
        "CommandKind",
        "DEFAULT_BROADCAST_TIMEOUT",
        "DEFAULT_HANDSHAKE_TIMEOUT",
        "DEFAULT_HEARTBEAT_INTERVAL",
        "DEFAULT_HEARTBEAT_TIMEOUT",
        "DEFAULT_JOIN_TIMEOUT",
        "DEFAULT_MAX_FRAME_BYTES",
        "FollowerChannel",
        "PROTOCOL_VERSION",
        "RecoverableRootChannel",
        "RootChannel",
        "TcpFollowerChannel",
        "TcpRootChannel",
        "USE_CHANNEL_DEFAULT",
        "UseChannelDefault",
        "local_channels",
        "tcp_follower",
        "tcp_root",
    ],
    "lampdist.launch": [
        "LaunchEnv",
        "PortExchange",
        "first_slurm_host",
        "from_env",
    ],
    "lampdist.ray": [
        "RunContext",
        "TrainSecret",
        "from_train_context",
        "report",
        "resume",
        "run",
        "run_context",
        "run_sync",
        "storage_dir",
    ],
    "lampdist.schedules": [
        "LearningRateSchedule",
        "RateSchedule",
        "ReduceOnPlateauState",
        "StepSchedule",
        "WarmupState",
        "cosine",
        "cyclic",
        "decrement",
        "from_epoch_count",
        "linear",
        "noop",
        "rate",
        "reduce_on_plateau",
        "state_from_json",
        "state_to_json",
        "step_after",
        "torchtitan_warmup_stable_decay",
        "transformers_constant_with_warmup",
        "transformers_cosine_with_warmup",
        "transformers_linear_with_warmup",
        "transformers_wsd",
        "warmup",
        "warmup_cosine_steps",
        "warmup_linear_steps",
    ],
    "lampdist.trackers": [
        "CsvTracker",
        "JsonLinesTracker",
        "MlflowTracker",
        "TensorBoardTracker",
        "Tracker",
        "fan_out",
    ],
}
PUBLIC_MODULES = sorted(PUBLIC_NAMES)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_the_public_names_are_pinned(name: str) -> None:
    assert importlib.import_module(name).__all__ == PUBLIC_NAMES[name]


def test_every_public_package_is_listed() -> None:
    """A module or package of lampdist whose name has no leading underscore is public, and
    so pinned above (``lampdist.cli`` is the command line, not an API); the rest (``_epoch``,
    ``_loop``, ``_roles``, ...) are private."""
    import pkgutil

    public = {
        f"lampdist.{info.name}"
        for info in pkgutil.iter_modules(lampdist.__path__)
        if not info.name.startswith("_")
    }
    assert public - {"lampdist.cli"} == set(PUBLIC_MODULES) - {"lampdist"}


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_names_exist_and_are_documented(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    for attr in module.__all__:
        obj = getattr(module, attr)
        assert obj.__doc__, f"{name}.{attr} has no docstring"


def test_errors_share_one_root_and_stdlib_bases() -> None:
    assert issubclass(lampdist.ConfigError, ValueError)
    assert issubclass(lampdist.LampdistTimeout, TimeoutError)
    assert issubclass(lampdist.NonFiniteLoss, ArithmeticError)
    for attr in lampdist.__all__:
        obj = getattr(lampdist, attr)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, lampdist.LampdistError)


def test_error_message_names_rank_and_phase_and_survives_pickle() -> None:
    error = lampdist.CollectiveFailed("peer closed", rank=2, phase="train")
    assert str(error) == "rank 2, phase 'train': peer closed"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is lampdist.CollectiveFailed
    assert (copy.rank, copy.phase, str(copy)) == (2, "train", str(error))


def _inert(value: object) -> bool:
    """A default that holds no live state: it reads the same to every caller and prints
    nothing of the machine (not the environment, not a mutable container)."""
    if value is None or isinstance(
        value, bool | int | float | str | bytes | enum.Enum | pathlib.PurePath
    ):
        return True
    if isinstance(value, tuple | frozenset):
        return all(_inert(item) for item in value)
    if isinstance(value, types.FunctionType):  # a module-level function: code, not state
        return True
    return attrs.has(type(value)) and _frozen(value)


def _frozen(value: Any) -> bool:
    fields = attrs.fields(type(value))
    if not fields:
        return True
    try:
        setattr(value, fields[0].name, getattr(value, fields[0].name))
    except attrs.exceptions.FrozenInstanceError:
        return True
    return False


def _public_callables() -> Iterator[tuple[str, Any]]:
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.isfunction(obj):
                yield f"{name}.{attr}", obj
            elif inspect.isclass(obj):
                for member, function in vars(obj).items():
                    if inspect.isfunction(function) and (
                        member == "__init__" or not member.startswith("_")
                    ):
                        yield f"{name}.{attr}.{member}", function


def _every_callable() -> Iterator[tuple[str, Any]]:
    """Every function and method defined in lampdist's modules, private ones included."""
    for info in pkgutil.walk_packages(lampdist.__path__, prefix="lampdist."):
        if info.name.endswith(".__main__"):
            continue  # importing it runs the command
        module = importlib.import_module(info.name)
        for attr, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # imported, not defined here
            if inspect.isfunction(obj):
                yield f"{info.name}.{attr}", obj
            elif inspect.isclass(obj):
                for member, function in vars(obj).items():
                    if inspect.isfunction(function):
                        yield f"{info.name}.{attr}.{member}", function


def test_no_default_argument_holds_live_state() -> None:
    """``help()``, ``inspect.signature`` and the API reference print defaults: a default such
    as ``os.environ`` would publish the environment (secrets included). Private functions
    too: ``help()`` of a private module prints them all."""
    found = list(_public_callables()) + list(_every_callable())
    assert len(found) > 500
    for name, function in found:
        for parameter in inspect.signature(function).parameters.values():
            if parameter.default is not parameter.empty:
                assert _inert(parameter.default), f"{name}({parameter.name}=...) holds live state"
    assert "LAMPDIST" not in str(inspect.signature(lampdist.launch.from_env))


def _classes_in(hint: object) -> Iterator[type]:
    if isinstance(hint, type):
        yield hint
    for arg in typing.get_args(hint):
        yield from _classes_in(arg)


def test_every_lampdist_type_in_a_public_signature_is_public() -> None:
    """A type the docs and the signatures name (``checkpoint_state: CheckpointLoopState``)
    can be imported from a public module."""
    public = {
        id(getattr(importlib.import_module(name), attr))
        for name in PUBLIC_MODULES
        for attr in importlib.import_module(name).__all__
    }
    for name, function in _public_callables():
        if name.endswith(".__init__"):  # instances come from factories (open_clique, ...)
            continue
        for hint in typing.get_type_hints(function).values():
            for cls in _classes_in(hint):
                if cls.__module__.startswith("lampdist"):
                    assert id(cls) in public, f"{name} names {cls.__qualname__}, not public"


def test_the_old_name_of_clique_factory_still_works_with_a_warning() -> None:
    """``lampdist.clique.Cliques`` was renamed ``CliqueFactory`` in 1.x: the old name goes on
    working until 2.0, with a DeprecationWarning; other missing names still raise."""
    import lampdist.clique

    with pytest.warns(DeprecationWarning, match="CliqueFactory"):
        old = lampdist.clique.Cliques  # the deprecated name, through the module's __getattr__
    assert old is lampdist.clique.CliqueFactory
    with pytest.raises(AttributeError, match="Nothing"):
        lampdist.clique.Nothing  # noqa: B018  # the point
