"""A first SIGINT or SIGTERM at any moment of a rank's start stops it in order.

Each case starts a rank that can never begin training (its peer is never started: a root
waits for its follower, a follower for its root), waits for a line that marks a moment of its
start (before the preload, after it, while its control channel opens, while it waits for its
peer), sends one signal, and waits for the process to end: it must exit ``128 + signum`` with
an error line naming the stop, and no traceback. Before, a signal that came before the signal
handlers were installed was lost (the root went on waiting for its followers) or ended the
process with a bare ``KeyboardInterrupt`` traceback from the preload.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest

ROOT_DIR = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT = 30.0
MARK_TIMEOUT = 60.0

SCRIPT = """
import logging, sys
import anyio, torch, lampdist

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
logging.getLogger("lampdist._roles._train").setLevel(logging.DEBUG)  # its first line: a mark

async def main() -> None:
    print("STARTED", file=sys.stderr, flush=True)
    await lampdist.train(
        data=lampdist.ModelWithData(
            model=lampdist.SupervisedModel(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss),
            train_batches=lambda: [(torch.ones(4, 2), torch.ones(4, 1))],
        ),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        loop=lampdist.LoopOptions(max_epochs=1),
    )

try:
    anyio.run(main)
except lampdist.Interrupted as stopped:
    print(f"lampdist-rank: {type(stopped).__name__}: {stopped}", file=sys.stderr)
    raise SystemExit(128 + stopped.signum) from None
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _environment(rank: int) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT_DIR / "src"), os.environ.get("PYTHONPATH", "")])
    return {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "LAMPDIST_SECRET": "signals-test",
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "LAMPDIST_PORT": str(_free_port()),
        "LAMPDIST_JOIN_TIMEOUT": "300",
    }


@attrs.define(eq=False)
class Watched:
    """A process whose stderr lines are read as they come."""

    process: subprocess.Popen[str]
    lines: list[str] = attrs.field(factory=list)
    changed: threading.Condition = attrs.field(factory=threading.Condition)

    def __attrs_post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def wait_for(self, mark: str) -> None:
        with self.changed:
            found = self.changed.wait_for(
                lambda: any(mark in line for line in self.lines) or self.process.poll() is not None,
                MARK_TIMEOUT,
            )
        text = "".join(self.lines)
        assert found and mark in text, f"no {mark!r} in:\n{text}"

    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)


def _script(tmp_path: Path, rank: int) -> Watched:
    path = tmp_path / "rank.py"
    path.write_text(SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=_environment(rank),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Watched(process)


def _demo(tmp_path: Path) -> Watched:
    flags = ["--role", "root", "--nranks", "2", "--port", str(_free_port()), "-v"]
    process = subprocess.Popen(
        [sys.executable, "-m", "lampdist", "demo", *flags, "--out", str(tmp_path / "run")],
        cwd=tmp_path,
        env=_environment(0),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Watched(process)


@attrs.frozen
class Moment:
    """Where in a rank's start the signal comes: once ``mark`` was printed, and ``after``
    seconds more."""

    entry: str  # "script root", "script follower" or "demo root"
    mark: str
    after: float = 0.0


MOMENTS = {
    # train() called and handling the signals, the preload not begun
    "root before the preload": Moment("script root", "stop the run from now on"),
    # a command's own set-up: the demo's data loaded and its model built, train() not called
    "demo before train()": Moment("demo root", "training on 2 ranks"),
    # the preload done, the control channel opening
    "root after the preload": Moment("script root", "rank 0 of 2 on"),
    # the root listening and waiting for its follower
    "root in the join": Moment("script root", "listening on"),
    "demo in the join": Moment("demo root", "listening on"),
    "follower before the preload": Moment("script follower", "stop the run from now on"),
    # the follower connecting to a root that is not there
    "follower in the join": Moment("script follower", "rank 1 of 2 on", after=0.5),
    "root during the preload": Moment("script root", "stop the run from now on", after=0.2),
}
QUICK = {"demo before train()", "root before the preload", "root in the join"}


@pytest.mark.parametrize(
    ("moment", "signum"),
    [
        pytest.param(
            name,
            signum,
            id=f"{name}-{signum.name}",
            marks=[] if name in QUICK and signum == signal.SIGINT else [pytest.mark.slow],
        )
        for name in MOMENTS
        for signum in (signal.SIGINT, signal.SIGTERM)
    ],
)
def test_a_first_signal_at_any_moment_of_the_start_stops_the_rank(
    tmp_path: Path, moment: str, signum: signal.Signals
) -> None:
    chosen = MOMENTS[moment]
    if chosen.entry == "demo root":
        rank = _demo(tmp_path)
    else:
        rank = _script(tmp_path, 0 if chosen.entry == "script root" else 1)
    try:
        rank.wait_for(chosen.mark)
        if chosen.after:
            time.sleep(chosen.after)  # the moment itself (the outcome is waited for below)
        rank.process.send_signal(signum)
        code = rank.process.wait(timeout=EXIT_TIMEOUT)
    finally:
        if rank.process.poll() is None:
            rank.process.kill()
            rank.process.wait()
    stderr = rank.text()
    assert code == 128 + signum, f"exit {code}:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert f"stopped by {signum.name}" in stderr, stderr
