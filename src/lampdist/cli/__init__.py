"""The ``lampdist`` command line: ``lampdist demo`` trains a small classifier end to end.

This is the only place in lampdist that configures logging and prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from .._errors import ConfigError, LampdistError
from ._checkpoint import (
    add_consolidate_action,
    add_export_action,
    add_inventory_actions,
    run_consolidate,
    run_export,
    run_ls,
    run_verify,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["main"]

logger = logging.getLogger(__name__)

EXAMPLES = """\
examples:
  lampdist demo                                  2 ranks in this process, on the CPU
  lampdist demo --device cuda                    one rank per GPU
  lampdist demo --resume                         continue the run in --out
  lampdist demo --tensorboard runs/demo          and: tensorboard --logdir runs
  torchrun --nproc-per-node 2 -m lampdist demo             one process per rank
  lampdist demo --role root --nranks 2 --port 29400        ranks started by hand
  lampdist demo --role follower --rank 1 --nranks 2 --port 29400
  (several processes need LAMPDIST_SECRET, the same in each)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lampdist`` command with ``argv`` (default: the process's arguments) and
    return its exit status: 0 on success, 2 for bad flags or settings, 1 for a failed run,
    ``128 + signum`` after a graceful stop on SIGTERM or SIGINT."""
    parser, commands = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the usage of the command they were meant for, not the top level's
        commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "checkpoint":
        return _checkpoint(args, commands)
    try:
        from rich.console import Console
    except ImportError:
        parser.error('the demo needs its extra: pip install "lampdist[demo]"')
    console = Console()
    _configure_logging(console, verbose=args.verbose)
    return _demo(args, console)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and the parser of each command by name (``"checkpoint ls"``
    for an action's)."""
    parser = argparse.ArgumentParser(
        prog="lampdist", description="Data-parallel PyTorch training driven from async Python."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a digits classifier data-parallel (scikit-learn's data, no download)",
        description=(
            "Train a small classifier on scikit-learn's digits with several ranks: a progress\n"
            "bar, checkpoints, a metrics file and a learning-curve PNG in --out, a summary."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    saved = commands.add_parser(
        "checkpoint",
        help="work with checkpoints: list, verify, consolidate, export",
        description=(
            "Work with the checkpoints of checkpoint.to_directory (a directory) and\n"
            "checkpoint.to_url (an object store URL such as s3://bucket/run)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = saved.add_subparsers(dest="action", metavar="ACTION")
    consolidate = add_consolidate_action(actions)
    export = add_export_action(actions)
    inventory = add_inventory_actions(actions)
    demo.add_argument("-v", "--verbose", action="store_true", help="log lampdist's INFO lines")
    demo.add_argument("--ranks", type=int, help="ranks in this process (default: 2; GPUs)")
    demo.add_argument("--epochs", type=int, default=10, help="epochs to train (default: 10)")
    demo.add_argument("--batch-size", type=int, default=32, help="per rank (default: 32)")
    demo.add_argument("--lr", type=float, default=0.003, help="Adam's (default: 0.003)")
    demo.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="Gloo or NCCL (default: cpu)"
    )
    demo.add_argument(
        "--out", type=Path, default=Path("lampdist-demo"), help="default: ./lampdist-demo"
    )
    demo.add_argument("--seed", type=int, default=0, help="split, start, shuffling (default: 0)")
    demo.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    demo.add_argument(
        "--tensorboard",
        type=Path,
        metavar="DIR",
        help='TensorBoard event files in DIR, from the root (pip install "lampdist[tensorboard]")',
    )
    ranks = demo.add_argument_group("ranks in separate processes, started by hand")
    ranks.add_argument("--role", choices=["root", "follower"])
    ranks.add_argument("--rank", type=int, help="this process's rank (the root is 0)")
    ranks.add_argument("--nranks", type=int, help="ranks in the run")
    ranks.add_argument("--host", default="127.0.0.1", help="the root's address")
    ranks.add_argument("--port", type=int, help="the root's control port")
    return parser, {
        "demo": demo,
        "checkpoint": saved,
        "checkpoint consolidate": consolidate,
        "checkpoint export": export,
        **{f"checkpoint {name}": action for name, action in inventory.items()},
    }


def _checkpoint(args: argparse.Namespace, commands: dict[str, argparse.ArgumentParser]) -> int:
    """``lampdist checkpoint ACTION``."""
    parser = commands["checkpoint"]
    if args.action == "ls":
        return run_ls(args, commands["checkpoint ls"])
    if args.action == "verify":
        return run_verify(args, commands["checkpoint verify"])
    if args.action == "consolidate":
        return run_consolidate(args, commands["checkpoint consolidate"])
    if args.action == "export":
        return run_export(args, commands["checkpoint export"])
    parser.print_help()
    return 2


def _configure_logging(console: Console, *, verbose: bool) -> None:
    from rich.logging import RichHandler

    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, log_time_format="[%X]")
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("lampdist").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger(__name__).setLevel(logging.INFO)


def _demo(args: argparse.Namespace, console: Console) -> int:
    from .._early_signals import note_signals_early

    # A signal from now on stops the command in order, even while it still imports.
    restore = note_signals_early()
    try:
        return _run_demo(args, console)
    finally:
        restore()


def _run_demo(args: argparse.Namespace, console: Console) -> int:
    from .._roles import Interrupted
    from ._demo import DemoOptions, run_demo_until_signal
    from ._summary import print_summary

    options = DemoOptions(
        ranks=args.ranks,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        device=args.device,
        out=args.out,
        seed=args.seed,
        resume=args.resume,
        role=args.role,
        rank=args.rank,
        nranks=args.nranks,
        host=args.host,
        port=args.port,
        tensorboard=args.tensorboard,
    )
    try:
        result = anyio.run(run_demo_until_signal, options, console, os.environ)
    except Interrupted as exc:
        name = signal.Signals(exc.signum).name
        if any((options.out / "checkpoints").glob("epoch-*")):
            logger.warning(
                "stopped by %s; continue with: lampdist demo --resume --out %s", name, options.out
            )
        elif options.role == "follower":
            logger.warning("stopped by %s", name)  # the root keeps the checkpoints
        else:
            logger.warning("stopped by %s before the first checkpoint: nothing to resume", name)
        return 128 + exc.signum
    except ConfigError as exc:
        logger.error("%s", exc)  # noqa: TRY400  # the message is the whole story
        return 2
    except LampdistError as exc:
        logger.error("the run failed: %s", exc)  # noqa: TRY400
        return 1
    if result is not None:
        print_summary(console, result)
    return 0
