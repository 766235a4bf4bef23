"""Each public module's ``__all__`` is honest: every name exists and is documented."""

from __future__ import annotations

import importlib
import pickle

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
        "CheckpointState",
        "CheckpointVersionError",
        "Clique",
        "CliqueError",
        "CliqueTimeout",
        "CollectiveFailed",
        "ConfigError",
        "ControlError",
        "CurvePoint",
        "Interrupted",
        "JoinRejected",
        "JoinTimeout",
        "LampdistError",
        "LampdistTimeout",
        "LoopOptions",
        "LoopState",
        "MismatchError",
        "ModelWithData",
        "NonFiniteLoss",
        "OnPassEvent",
        "OptimizerFactory",
        "PassEvent",
        "PeerDisconnected",
        "ProtocolError",
        "RankFailed",
        "Resumed",
        "SaveBestModel",
        "StepOptions",
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
        "follow_distributed_training",
        "launch",
        "local_data_parallel_training_loop",
        "open_clique",
        "run_until_signal",
        "schedules",
        "train",
    ],
    "lampdist.checkpoint": [
        "FORMAT_VERSION",
        "Resumed",
        "load_latest",
        "to_directory",
    ],
    "lampdist.clique": [
        "Clique",
        "CliqueId",
        "Cliques",
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
    "lampdist.schedules": [
        "LearningRateSchedule",
        "ReduceOnPlateauState",
        "WarmupState",
        "cosine",
        "cyclic",
        "decrement",
        "from_epoch_count",
        "linear",
        "noop",
        "reduce_on_plateau",
        "state_from_json",
        "state_to_json",
        "step_after",
        "warmup",
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
