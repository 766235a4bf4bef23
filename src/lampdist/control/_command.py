"""Commands: what the root tells the followers to do next, one per pass."""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs

from .._errors import ConfigError, Phase, ProtocolError

__all__ = ["MAX_TEXT_CHARS", "Command", "CommandKind"]

#: Longest error text a command carries on the wire; longer texts are cut (with a marker).
MAX_TEXT_CHARS = 4096


class CommandKind(enum.Enum):
    """What a follower does next: run a training pass, run a validation pass, hand the root
    its part of a checkpoint, or stop."""

    TRAIN = "train"
    VALID = "valid"
    CHECKPOINT = "checkpoint"
    STOP = "stop"

    @property
    def phase(self) -> Phase:
        """The phase a rank is in while it carries this command out: the kind's value."""
        return self.value


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"Command.{name} must be an integer >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class Command:
    """One instruction from the root to every follower.

    ``epoch`` is the epoch the pass belongs to, ``pass_index`` counts passes from 0 and
    increases over the run. ``lr_factor`` is the learning-rate factor of a training pass (the
    followers stepping on the root do not step an optimizer, the others scale their learning
    rates by it). CHECKPOINT comes before the root checkpoints an epoch: every rank hands the
    root what it holds of the checkpoint (its slice of a sharded optimizer state, its place in
    its training data, its RNG states). ``error`` is set only on a STOP that aborts the run:
    followers then raise :class:`lampdist.RankFailed` (``rank=0``) with it.

    Raises :class:`lampdist.ConfigError` for a negative count, a non-finite ``lr_factor`` or an
    ``error`` on anything but STOP.
    """

    kind: CommandKind
    epoch: int
    pass_index: int
    lr_factor: float | None = None
    error: str | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, CommandKind):
            raise ConfigError(f"Command.kind must be a CommandKind, got {self.kind!r}")
        _check_count("epoch", self.epoch)
        _check_count("pass_index", self.pass_index)
        if self.lr_factor is not None and (
            not isinstance(self.lr_factor, int | float)
            or isinstance(self.lr_factor, bool)
            or not math.isfinite(self.lr_factor)
        ):
            raise ConfigError(f"Command.lr_factor must be a finite float, got {self.lr_factor!r}")
        if self.error is not None:
            if not isinstance(self.error, str):
                raise ConfigError(f"Command.error must be a string, got {self.error!r}")
            if self.kind is not CommandKind.STOP:
                raise ConfigError("only a STOP command carries an error")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the wire form); an overlong ``error`` is cut to MAX_TEXT_CHARS."""
        data: dict[str, Any] = {
            "kind": self.kind.value,
            "epoch": self.epoch,
            "pass_index": self.pass_index,
        }
        if self.lr_factor is not None:
            data["lr_factor"] = float(self.lr_factor)
        if self.error is not None:
            data["error"] = clip_text(self.error)
        return data

    @classmethod
    def from_json(cls, data: object) -> Command:
        """Parse :meth:`to_json`'s output; raises :class:`lampdist.ProtocolError` on anything
        else."""
        if not isinstance(data, dict):
            raise ProtocolError(f"a command must be an object, got {type(data).__name__}")
        try:
            kind = CommandKind(data.get("kind"))
        except ValueError:
            raise ProtocolError(f"unknown command kind {data.get('kind')!r}") from None
        epoch, pass_index = data.get("epoch"), data.get("pass_index")
        lr_factor, error = data.get("lr_factor"), data.get("error")
        if not isinstance(epoch, int) or not isinstance(pass_index, int):
            raise ProtocolError("a command needs integer 'epoch' and 'pass_index'")
        if lr_factor is not None and not isinstance(lr_factor, int | float):
            raise ProtocolError(f"a command's 'lr_factor' must be a number, got {lr_factor!r}")
        if error is not None and (not isinstance(error, str) or len(error) > MAX_TEXT_CHARS):
            raise ProtocolError("a command's 'error' must be a string of bounded length")
        try:
            return cls(
                kind=kind,
                epoch=epoch,
                pass_index=pass_index,
                lr_factor=lr_factor,
                error=error,
            )
        except ConfigError as exc:
            raise ProtocolError(f"invalid command: {exc.message}") from None


def clip_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, marked when cut."""
    if len(text) <= limit:
        return text
    marker = " ... [cut]"
    return text[: limit - len(marker)] + marker
