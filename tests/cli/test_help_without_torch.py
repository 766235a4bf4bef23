"""``lampdist --help`` and ``lampdist demo --help`` print their help without importing torch
(seconds of start-up, and a command line that works before torch is installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The modules imported by the end, printed from a finally: argparse's help exits.
SCRIPT = """
import sys, lampdist.cli
try:
    raise SystemExit(lampdist.cli.main(sys.argv[1:]))
finally:
    print("imported:", *sorted(sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("argv", "usage"),
    [(["--help"], "usage: lampdist"), (["demo", "--help"], "usage: lampdist demo"), ([], "")],
    ids=["help", "demo-help", "no-command"],
)
def test_help_imports_no_torch(argv: list[str], usage: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == (0 if argv else 2), done.stderr
    assert f"{usage or 'usage: lampdist'} " in done.stdout
    imported = done.stderr.rsplit("imported:", 1)[1].split()
    assert "lampdist.cli" in imported
    torch = [name for name in imported if name == "torch" or name.startswith("torch.")]
    assert torch == []
