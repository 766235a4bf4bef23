"""Which process a rank is, so that rank 0 can end a silent one on its own machine.

A rank that stops (SIGSTOP, a debugger, a hung driver call) keeps its connections open: no
launcher sees it fail, and a launcher that names the first process to fail (torchrun's "Root
Cause") would name a rank that noticed it instead. So each rank notes in the clique's store
who it is (the machine's boot id, its PID namespace, its PID and the PID's start time), and
rank 0, once the control channel finds a follower unresponsive, ends that follower's process
with SIGKILL when it runs on the same machine and PID namespace and is still the process that
joined (a PID reused since then has another start time). Elsewhere the process is left to
find out when it wakes up (its connections were shut down meanwhile).

Linux only (``/proc``); elsewhere a rank notes nothing and no process is ended.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

__all__ = ["end_if_local", "identity"]

logger = logging.getLogger(__name__)

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PID_NAMESPACE = "/proc/self/ns/pid"


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _machine() -> tuple[str, int] | None:
    try:
        return _BOOT_ID.read_text().strip(), os.stat(_PID_NAMESPACE).st_ino
    except OSError:
        return None


def identity() -> str:
    """This process, as text for the store ("" where it cannot be told)."""
    machine, pid = _machine(), os.getpid()
    start = _start_time(pid)
    if machine is None or start is None:
        return ""
    return json.dumps({"boot": machine[0], "pidns": machine[1], "pid": pid, "start": start})


def end_if_local(noted: str) -> int | None:
    """SIGKILL the process that ``noted`` (its :func:`identity`) names, if it runs on this
    machine in this PID namespace, is not this process, and is still the one noted; its PID,
    or ``None`` when it was not ended."""
    try:
        peer = json.loads(noted) if noted else None
        if not isinstance(peer, dict):
            return None
        pid = int(peer["pid"])
        same_place = (str(peer["boot"]), int(peer["pidns"])) == _machine()
    except (ValueError, KeyError, TypeError):
        return None
    if not same_place or pid == os.getpid() or _start_time(pid) != peer["start"]:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as exc:  # gone meanwhile, or not ours to signal
        logger.debug("could not end process %d: %s", pid, exc)
        return None
    return pid
