"""A real S3 endpoint for the tests: moto's standalone server in a subprocess, on a free port.

The tests reach it through the environment a user would set (``AWS_ENDPOINT_URL`` and
friends) and obstore's own client: no patched client, real HTTP. The server can be paused
(SIGSTOP: a store that stops answering), resumed, and killed and restarted empty on the same
port (a store that loses an upload).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import attrs
import pytest

__all__ = ["ENVIRONMENT", "S3Server", "free_port", "set_environment", "start_server"]

_READY_TIMEOUT = 60.0
"""Seconds the server may take to answer after it is started."""

ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "lampdist-test-key",
    "AWS_SECRET_ACCESS_KEY": "lampdist-test-secret",
    "AWS_ALLOW_HTTP": "true",
    "AWS_REGION": "us-east-1",
}
"""What a user's environment would hold, but the endpoint."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@attrs.define(eq=False)
class S3Server:
    """moto's S3 server, a subprocess answering at :attr:`endpoint`."""

    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it and wait until it answers; raises RuntimeError when it does not."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto exited with status {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"moto did not answer at {self.endpoint} in {_READY_TIMEOUT} s")

    def create_bucket(self, name: str | None = None) -> str:
        """A new bucket's name."""
        boto3 = pytest.importorskip("boto3")
        name = name or f"lampdist-{secrets.token_hex(4)}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=ENVIRONMENT["AWS_REGION"],
            aws_access_key_id=ENVIRONMENT["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket=name)
        return name

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap (resuming it first, should it be paused)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
            os.kill(self.process.pid, signal.SIGCONT)
        self.process.wait(timeout=30)
        self.process = None

    def restart(self) -> None:
        """Kill it and start a fresh, empty one on the same port."""
        self.kill()
        self.start()


def start_server() -> S3Server:
    """A started server on a free port (skips the test without moto, boto3 or obstore)."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    server = S3Server(port=free_port())
    server.start()
    return server


def set_environment(monkeypatch: pytest.MonkeyPatch, server: S3Server) -> None:
    """The environment of a user of ``server``."""
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
