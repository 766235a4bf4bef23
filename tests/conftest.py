from __future__ import annotations

import importlib.util

import pytest

_BACKENDS = [
    "asyncio",
    pytest.param(
        "trio",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("trio") is None, reason="trio is not installed"
        ),
    ),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="run the tests marked slow (fault injection, soak): `nox -s slow`",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (nox -s slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Async tests run on asyncio and trio unless a test module narrows this fixture."""
    return str(request.param)
