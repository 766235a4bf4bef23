"""Fixtures of the checkpoint tests: a real S3 endpoint (moto's server, see s3_server.py)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from .s3_server import S3Server, set_environment, start_server


@pytest.fixture(scope="session")
def shared_s3_server() -> Iterator[S3Server]:
    """One moto server for the tests that neither pause nor kill it."""
    server = start_server()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3_url(shared_s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<bucket>/<run>``: a fresh bucket on the shared server, the environment set."""
    set_environment(monkeypatch, shared_s3_server)
    return f"s3://{shared_s3_server.create_bucket()}/run-{secrets.token_hex(3)}"


@pytest.fixture
def own_s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """A moto server of this test's own (to pause, kill or restart), the environment set."""
    server = start_server()
    set_environment(monkeypatch, server)
    try:
        yield server
    finally:
        server.kill()
