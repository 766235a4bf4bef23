"""Run a program in a network namespace that has only the loopback.

A local Ray instance binds to the machine's own interface address even when asked for
127.0.0.1; in a namespace whose only interface is ``lo`` it uses 127.0.0.1, so no Ray traffic
leaves the machine. Creating the namespace (``unshare -n``) needs root, as the tests and CI
run; elsewhere the tests that need it are skipped, saying why.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

import pytest

__all__ = ["needs_loopback_namespace", "run_in_loopback_namespace"]


def _why_not() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs `unshare` and `ip` (util-linux, iproute2) for a loopback-only namespace"
    if os.geteuid() != 0:
        return "needs root to create a loopback-only network namespace (`unshare -n`)"
    return None


needs_loopback_namespace = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def run_in_loopback_namespace(
    arguments: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python arguments...`` (this interpreter) in a new network namespace with only
    ``lo``, up; returns its completed process (output captured as text)."""
    command = " ".join(shlex.quote(part) for part in (sys.executable, *arguments))
    environment = dict(os.environ if env is None else env)
    environment.setdefault("RAY_AUTH_MODE", "disabled")  # a local instance, in its namespace
    return subprocess.run(
        ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {command}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        check=False,
    )
