"""``lampdist checkpoint ls``, ``verify``, ``consolidate`` and ``export``: what a checkpoint
directory or an object store's prefix holds, whether it is intact, and its model as one file
(a torch state dict, safetensors, or a Hugging Face model directory)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .._errors import ConfigError, LampdistError
from .._words import counted

if TYPE_CHECKING:
    from .._checkpoint import Listed

__all__ = [
    "add_consolidate_action",
    "add_export_action",
    "add_inventory_actions",
    "run_consolidate",
    "run_export",
    "run_ls",
    "run_verify",
]


def _add_store_options(parser: argparse.ArgumentParser) -> None:
    """``-o/--option KEY=VALUE``: every action that reads a location takes it."""
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an object store option, e.g. endpoint=http://127.0.0.1:9000 (repeatable)",
    )


def add_consolidate_action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``consolidate`` to ``lampdist checkpoint``'s actions; its parser."""
    consolidate = actions.add_parser(
        "consolidate",
        help="write the newest checkpoint's model as one plain state_dict",
        description=(
            "Write the model of the newest intact checkpoint in LOCATION (a directory or an\n"
            "object store URL) as one plain state_dict\n"
            "to OUT (torch.load(OUT, weights_only=True) reads it), whether every rank wrote\n"
            "its shards (step_on='fsdp') or the root the whole model.\n"
            "Exit status: 0 when written, 1 when reading or writing fails, 2 for bad\n"
            "arguments or options."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    consolidate.add_argument(
        "directory", metavar="LOCATION", help="a checkpoint directory or an object store URL"
    )
    consolidate.add_argument("out", metavar="OUT", type=Path, help="the state_dict file to write")
    _add_epoch_option(consolidate)
    _add_store_options(consolidate)
    return consolidate


def _add_epoch_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--epoch",
        type=int,
        metavar="N",
        help="the checkpoint of epoch N there (default: the location itself when it is one "
        "checkpoint, else the newest intact one)",
    )


def add_export_action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``export`` to ``lampdist checkpoint``'s actions; its parser."""
    export = actions.add_parser(
        "export",
        help="write a checkpoint's model weights as safetensors, torch or a Hugging Face model",
        description=(
            "Write the model weights of a checkpoint in CKPT (one checkpoint's directory or\n"
            "URL, or a run's: its newest intact checkpoint, or that of --epoch) to OUT:\n"
            "a safetensors file, a torch.save state dict (--format torch), or with --hf a\n"
            "Hugging Face model directory that from_pretrained loads. A sharded (fsdp)\n"
            "checkpoint is consolidated one tensor at a time (--hf holds the whole model).\n"
            "Exit status: 0 when written, 1 when reading or writing fails, 2 for bad\n"
            "arguments or options."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument(
        "location", metavar="CKPT", help="a checkpoint or run directory, or an object store URL"
    )
    export.add_argument("out", metavar="OUT", type=Path, help="the file (--hf: directory) to write")
    export.add_argument(
        "--format",
        choices=["safetensors", "torch"],
        default="safetensors",
        help="the weights' file format (default: safetensors)",
    )
    export.add_argument("--best", action="store_true", help="the best model, not the last")
    export.add_argument(
        "--hf",
        metavar="CONFIG",
        help="the model's transformers config (its directory or config.json): write a "
        "Hugging Face model directory",
    )
    _add_epoch_option(export)
    _add_store_options(export)
    return export


def add_inventory_actions(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
) -> dict[str, argparse.ArgumentParser]:
    """Add ``ls`` and ``verify`` to ``lampdist checkpoint``'s actions; their parsers."""
    ls = actions.add_parser(
        "ls",
        help="list the committed checkpoints, newest first",
        description=(
            "List the committed checkpoints in LOCATION (a checkpoint directory, or an object\n"
            "store URL such as s3://bucket/run), newest first: name, epoch, size, and with\n"
            "--verify whether every file matches its manifest's checksums."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify = actions.add_parser(
        "verify",
        help="check every committed checkpoint against its manifest",
        description=(
            "Read every file of every committed checkpoint in LOCATION (a directory or an\n"
            "object store URL) and check it against its manifest's sizes and checksums.\n"
            "Exit status: 0 when all verify, 1 when any is damaged, 2 for bad arguments."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for parser in (ls, verify):
        parser.add_argument(
            "location", metavar="LOCATION", help="a checkpoint directory or an object store URL"
        )
        _add_store_options(parser)
    ls.add_argument("--verify", action="store_true", help="check every file's checksums too")
    return {"ls": ls, "verify": verify}


def _options(values: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, str] | None:
    options = {}
    for value in values:
        key, separator, setting = value.partition("=")
        if not separator or not key:
            parser.error(f"--option takes KEY=VALUE, not {value!r}")
        options[key.strip()] = setting
    return options or None


def _listed(
    args: argparse.Namespace, parser: argparse.ArgumentParser, *, verify: bool
) -> list[Listed] | int:
    """The checkpoints, or the exit status of a failure (its message printed)."""
    from .._checkpoint import is_url, list_checkpoints

    if not is_url(args.location) and not Path(args.location).is_dir():
        parser.error(f"{args.location} is neither a directory nor an object store URL")
    options = _options(args.option, parser)
    try:
        return list_checkpoints(args.location, verify=verify, options=options)
    except LampdistError as exc:
        return _failed(args.action, exc)


def run_ls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``lampdist checkpoint ls``: a table of the checkpoints; 0, or 1 when listing fails."""
    listed = _listed(args, parser, verify=args.verify)
    if isinstance(listed, int):
        return listed
    if not listed:
        print(f"no checkpoints in {args.location}")
        return 0
    rows = [("NAME", "EPOCH", "SIZE (MB)", "VERIFIED", "PROBLEM")]
    for item in listed:
        verified = "-" if item.verified is None else ("yes" if item.verified else "no")
        size = f"{item.size / 1e6:.1f}"
        rows.append((item.name, str(item.epoch), size, verified, item.problem or ""))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    for row in rows:
        cells = [
            row[0].ljust(widths[0]),
            row[1].rjust(widths[1]),
            row[2].rjust(widths[2]),
            row[3].ljust(widths[3]),
            row[4],
        ]
        print("  ".join(cells).rstrip())
    return 0


def run_verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``lampdist checkpoint verify``: 0 when every checkpoint verifies, 1 when any is
    damaged (each named, with what is wrong) or listing fails, 2 for bad arguments."""
    listed = _listed(args, parser, verify=True)
    if isinstance(listed, int):
        return listed
    damaged = [item for item in listed if not item.verified]
    for item in listed:
        if item.verified:
            print(f"ok       {item.location}")
        else:
            print(f"DAMAGED  {item.location}: {item.problem}")
    if damaged:
        names = ", ".join(item.name for item in damaged)
        print(f"{len(damaged)} of {len(listed)} checkpoints damaged: {names}", file=sys.stderr)
        return 1
    print(f"{counted(len(listed), 'checkpoint')} verified in {args.location}")
    return 0


def run_consolidate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``lampdist checkpoint consolidate``: 0 once OUT is written, 1 when reading or writing
    fails, 2 for bad options."""
    from ..checkpoint import consolidate

    options = _options(args.option, parser)
    try:
        source = consolidate(args.directory, args.out, epoch=args.epoch, options=options)
    except LampdistError as exc:
        return _failed("consolidate", exc)
    print(f"wrote {args.out} from {source}")
    return 0


def run_export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``lampdist checkpoint export``: 0 once OUT is written, 1 when reading or writing
    fails, 2 for bad arguments or options."""
    from ..checkpoint import export, export_hf

    options = _options(args.option, parser)
    chosen = {"best": args.best, "epoch": args.epoch, "options": options}
    try:
        if args.hf is not None:
            source = export_hf(args.location, args.hf, args.out, format=args.format, **chosen)
        else:
            source = export(args.location, args.out, format=args.format, **chosen)
    except LampdistError as exc:
        return _failed("export", exc)
    print(f"wrote {args.out} from {source}")
    return 0


def _failed(action: str, error: LampdistError) -> int:
    """Say why ``action`` failed; its exit status: 2 for bad settings, else 1."""
    print(f"lampdist checkpoint {action}: {error}", file=sys.stderr)
    return 2 if isinstance(error, ConfigError) else 1
