"""Each public module's ``__all__`` is honest: every name exists and is documented."""

from __future__ import annotations

import importlib
import pickle

import pytest

import lampdist

PUBLIC_MODULES = [
    "lampdist",
    "lampdist.checkpoint",
    "lampdist.clique",
    "lampdist.control",
    "lampdist.launch",
    "lampdist.schedules",
]


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
