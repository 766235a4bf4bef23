"""The event loop's idle OpenMP team is given back, so that only the compute thread keeps one.

Each case runs in a fresh interpreter: OpenMP teams are per thread and live as long as it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, time, torch
    from lampdist._openmp import release_team

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    before = threads()
    a = torch.randn(512, 512)
    (a @ a).sum()  # an intra-op-parallel op: this thread gets a team of 2
    with_team = threads()
    supported = release_team()
    # The team's threads leave after the call returns, each on its own: wait for them
    deadline = time.monotonic() + 10
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    after = threads()
    print(before, with_team, after, supported)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="counts threads in /proc")
def test_release_team_gives_back_the_calling_threads_idle_team() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    before, with_team, after, supported = done.stdout.split()
    if supported != "True":
        pytest.skip("this torch build does not use GNU OpenMP")
    assert int(with_team) == int(before) + 1  # the team's second thread
    assert int(after) == int(before)
