"""A rank's trail: its step and its last collectives, and the ranks' account of a hang.

Whichever thread starts a collective records it in the rank's :class:`Trail` (under the
group's lock: a number, a name, a size, a start time), the completion callback notes its end,
and the training loop notes its step (:meth:`~lampdist.Clique.at_step`). Nothing of this
leaves the rank on the step path.

When a collective times out, the rank asks its peers for their trails through the clique's
store (:func:`ask`: one counter, ``hang/asked``); each rank's watcher thread, which polls the
store anyway, answers with a small JSON of its trail under ``hang/answer/<rank>``
(:func:`answer`). The rank waits up to :data:`ANSWER_WAIT` seconds and names, for every rank,
where it is (:func:`account`); a rank that did not answer in time is named as such.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import Any

import attrs

from .._errors import Collective, Phase

__all__ = ["ANSWER_WAIT", "Entry", "Trail", "account", "answer", "ask", "asked"]

logger = logging.getLogger(__name__)

_KEPT = 4  # the collectives a rank remembers
_ASK_KEY = "hang/asked"  # how many times a rank has asked for the trails
ANSWER_WAIT = 2.5  # how long a rank whose collective timed out waits for its peers' trails
_ASK_POLL = 0.05  # how often it looks for their answers


@attrs.define(eq=False)
class Entry:
    """One started collective; ``ended`` (``time.monotonic()``) once it completed or
    failed (``failed``; set before ``ended``)."""

    seq: int
    name: Collective
    nbytes: int
    started: float
    ended: float | None = None
    failed: bool = False


@attrs.define(eq=False)
class Trail:
    """A rank's last step and last :data:`_KEPT` collectives.

    Invariant: :meth:`start` and :meth:`snapshot` run under the owning group's lock (the
    collectives' numbers follow the order of issue); ``step`` and an entry's ``ended`` are
    single attribute stores, written from any thread and read by the watcher.
    """

    step: tuple[int, Phase, int, float] | None = None
    """``(epoch, phase, step, time.monotonic())`` of the last :meth:`~lampdist.Clique.at_step`."""
    _entries: deque[Entry] = attrs.field(factory=lambda: deque(maxlen=_KEPT), init=False)
    _count: int = attrs.field(default=0, init=False)

    def start(self, name: Collective, nbytes: int, started: float) -> Entry:
        """Record the next collective (under the group's lock)."""
        self._count += 1
        entry = Entry(self._count, name, nbytes, started)
        self._entries.append(entry)
        return entry

    def snapshot(self) -> dict[str, Any]:
        """The trail as JSON-able data, times as ages in seconds (under the group's lock)."""
        now = time.monotonic()
        step = self.step
        return {
            "step": None if step is None else [step[0], step[1], step[2], now - step[3]],
            "collectives": [
                [
                    e.seq,
                    e.name,
                    e.nbytes,
                    now - e.started,
                    None if e.ended is None else now - e.ended,
                    e.failed,
                ]
                for e in self._entries
            ],
        }


def _answer_key(rank: int) -> str:
    return f"hang/answer/{rank}"


def asked(keys: Any) -> int:
    """How many times the ranks have asked for the trails (one store operation). Store
    errors propagate."""
    return int(keys.add(_ASK_KEY, 0))


def answer(keys: Any, rank: int, request: int, trail: dict[str, Any]) -> None:
    """Post ``rank``'s ``trail`` (a :meth:`Trail.snapshot`) in answer to request
    ``request``. Store errors propagate."""
    keys.set(_answer_key(rank), json.dumps({"asked": request, **trail}))


def ask(keys: Any, rank: int, nranks: int, wait: float) -> dict[int, dict[str, Any]]:
    """Ask the other ranks for their trails and wait up to ``wait`` seconds for the answers
    posted after this request; the answers received, by rank. A store that fails ends the
    wait (what was received is kept); each store operation has the store's own limit."""
    deadline = time.monotonic() + wait
    answers: dict[int, dict[str, Any]] = {}
    missing = [peer for peer in range(nranks) if peer != rank]
    try:
        request = int(keys.add(_ASK_KEY, 1))
        while missing:
            for peer in list(missing):
                key = _answer_key(peer)
                if not keys.check([key]):
                    continue
                try:
                    found = json.loads(keys.get(key))
                except ValueError:
                    continue
                if isinstance(found, dict) and int(found.get("asked", 0)) >= request:
                    answers[peer] = found
                    missing.remove(peer)
            if missing and time.monotonic() < deadline:
                time.sleep(_ASK_POLL)
            else:
                break
    except Exception as exc:  # the store is gone: the ranks not heard from did not answer
        logger.debug("rank %d: asking the peers for their trails failed: %s", rank, exc)
    return answers


def size(nbytes: int) -> str:
    """``nbytes`` for a reader: ``"16 B"``, ``"4.0 MiB"``."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def _label(collective: list[Any]) -> str:
    seq, name, nbytes = collective[:3]
    return f"{name} #{seq} ({size(int(nbytes))})"


def label(entry: Entry) -> str:
    """``"all_reduce #12 (4.0 MiB)"``."""
    return _label([entry.seq, entry.name, entry.nbytes])


def _where(rank: int, trail: dict[str, Any] | None, wait: float) -> str:
    if trail is None:
        return f"rank {rank} did not answer within {wait:g} s"
    step = trail.get("step")
    text = f"rank {rank}"
    if step:
        epoch, phase, index, age = step
        text += f" at epoch {epoch} {phase} step {index} (for {age:.1f} s)"
    else:
        text += " (no step noted)"
    collectives = trail.get("collectives") or []
    running = [c for c in collectives if c[4] is None]
    done = [c for c in collectives if c[4] is not None]
    if running:
        first, *more = running
        text += f": waiting {first[3]:.1f} s in {_label(first)}"
        if more:
            text += " and in " + ", ".join(_label(c) for c in more)
    elif done and len(done[-1]) > 5 and done[-1][5]:  # it gave up on its last collective
        last = done.pop()
        text += f": {_label(last)} failed {last[4]:.1f} s ago, after {last[3] - last[4]:.1f} s"
    elif done:
        last = done.pop()
        text += f": not in a collective for {last[4]:.1f} s, since {_label(last)} ended"
    else:
        text += ": no collective started"
    if done:
        text += " (before: " + ", ".join(_label(c) for c in reversed(done)) + ")"
    return text


def account(trails: dict[int, dict[str, Any]], rank: int, nranks: int, wait: float) -> str:
    """Where every rank is, from their ``trails`` (rank ``rank``'s own among them); the
    ranks missing did not answer within ``wait`` seconds. Ends by naming the ranks that have
    not started the collective that rank ``rank`` waits for, where the search starts."""
    where = "; ".join(_where(peer, trails.get(peer), wait) for peer in range(nranks))
    text = f"Where the ranks are: {where}."
    own = [c for c in (trails.get(rank) or {}).get("collectives", []) if c[4] is None]
    if own:
        seq = own[0][0]
        behind = [
            peer
            for peer, trail in sorted(trails.items())
            if max((c[0] for c in trail.get("collectives") or []), default=0) < seq
        ]
        if behind:
            who = ", ".join(map(str, behind))
            ranks = f"Ranks {who} have" if len(behind) > 1 else f"Rank {who} has"
            text += f" {ranks} not started {_label(own[0])}: look there first."
    return text
