"""The agreement check at join: every rank has the root's model layout and step options.

One all-gather of two 56-bit digests settles the normal case. When a digest differs, a second
all-gather carries each rank's full description (compressed, in a fixed-size buffer) so that
the error names the parameters and settings that differ, on every rank alike.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Sequence

import torch

from .._epoch import FlatParameters, host_to_device
from .._errors import MismatchError
from .._options import StepOptions
from ..clique import Clique

__all__ = ["agree"]

DETAIL_BYTES = 1 << 16
"""The second round's buffer per rank: a 4-byte length, then the zlib-compressed description."""

_SHOWN = 3
"""Differences named per rank and kind; the rest are counted."""


def agree(
    clique: Clique,
    flat: FlatParameters,
    options: StepOptions,
    validates: bool,
    metrics: Sequence[tuple[str, str]] = (),
    validation_sets: Sequence[str] = (),
) -> None:
    """Check on every rank that all ranks have the root's model layout and step options, and
    validate alike (the same named ``validation_sets`` in the same order), with the same
    ``metrics`` (each as (name, what it sums): see
    ``lampdist._metric.metric_layout``) (on the rank's compute thread: it waits for the
    peers and reads the result from the device).

    Raises :class:`MismatchError` on every rank, naming the ranks that differ and in what
    (``rank 2: parameter 'fc.weight': shape (7, 4), ... (the root: shape (6, 4), ...)``).
    """
    settings = [*_settings(options, validates), *metrics]
    if validation_sets:  # one source's settings stay as they were
        settings.append(("validation sets", repr(tuple(validation_sets))))
    mine = host_to_device(
        [_digest64(flat.fingerprint()), _digest64(repr(settings).encode())],
        torch.int64,
        clique.device,
    )
    gathered = torch.zeros(2 * clique.nranks, dtype=torch.int64, device=clique.device)
    clique.start_all_gather(gathered, mine).wait_blocking(None)
    rows = gathered.view(clique.nranks, 2).tolist()
    model_ranks = [r for r, row in enumerate(rows) if row[0] != rows[0][0]]
    settings_ranks = [r for r, row in enumerate(rows) if row[1] != rows[0][1]]
    if not model_ranks and not settings_ranks:
        return
    described = _gather_descriptions(clique, flat.layout, settings)
    problems = []
    for ranks, key, what in (
        (
            model_ranks,
            "layout",
            "model parameters or buffers (names, shapes, dtypes, requires_grad)",
        ),
        (settings_ranks, "settings", "settings"),
    ):
        if ranks:
            details = "; ".join(
                _differences(rank, described[rank][key], described[0][key]) for rank in ranks
            )
            problems.append(f"ranks {ranks} have {what} that differ from the root's ({details})")
    raise MismatchError(
        "; ".join(problems) + ": give every rank the same model and settings",
        rank=clique.rank,
        phase="agreement",
    )


def _settings(options: StepOptions, validates: bool) -> list[tuple[str, str]]:
    """Every step option and whether validation batches were given, as (name, value)."""
    return [*options.agreed_fields(), ("validation_batches given", repr(validates))]


def _gather_descriptions(
    clique: Clique, layout: tuple[tuple[str, str], ...], settings: list[tuple[str, str]]
) -> list[dict[str, list[list[str]]]]:
    """Every rank's layout and settings, by rank (a collective: every rank calls it)."""
    described = {"layout": [list(entry) for entry in layout], "settings": settings}
    payload = zlib.compress(json.dumps(described).encode())
    if len(payload) > DETAIL_BYTES - 4:  # a model of very many tensors: name the settings only
        described["layout"] = [["(too many parameters to list)", ""]]
        payload = zlib.compress(json.dumps(described).encode())
    buffer = torch.zeros(DETAIL_BYTES, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(len(payload).to_bytes(4, "big")), dtype=torch.uint8)
    buffer[4 : 4 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = torch.zeros(clique.nranks * DETAIL_BYTES, dtype=torch.uint8, device=clique.device)
    clique.start_all_gather(gathered, buffer.to(clique.device)).wait_blocking(None)
    rows = gathered.cpu().view(clique.nranks, DETAIL_BYTES)
    result = []
    for row in rows:
        data = bytes(row.tolist())
        size = int.from_bytes(data[:4], "big")
        result.append(json.loads(zlib.decompress(data[4 : 4 + size])))
    return result


def _differences(rank: int, theirs: list[list[str]], roots: list[list[str]]) -> str:
    """``"rank R: parameter 'a': X (the root: Y); ..."``: at most :data:`_SHOWN` of the
    differences between two lists of (name, description), the rest counted."""
    mine = {name: value for name, value in theirs}
    root = {name: value for name, value in roots}
    found = []
    for name, value in root.items():
        if name not in mine:
            found.append(f"no {name} (the root: {value})")
        elif mine[name] != value:
            found.append(f"{name}: {mine[name]} (the root: {value})")
    extra = [name for name in mine if name not in root]
    found += [f"{name}: {mine[name]} (the root has none)" for name in extra]
    if not found:  # the same entries in another order
        found.append("the same entries in another order than the root's")
    shown = "; ".join(found[:_SHOWN])
    more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    return f"rank {rank}: {shown}{more}"


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:7], "big")
