"""Commands: what the root tells the followers to do next, one per pass."""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs

from .._clique_id import CliqueId
from .._errors import ConfigError, Phase, ProtocolError
from .._state import LoopState
from .._state_json import loop_state_from_json, loop_state_to_json

__all__ = ["MAX_TEXT_CHARS", "Command", "CommandKind"]

#: Longest error text a command carries on the wire; longer texts are cut (with a marker).
MAX_TEXT_CHARS = 4096


class CommandKind(enum.Enum):
    """What a follower does next: run a training pass, run a validation pass, hand the root
    its part of a checkpoint, or stop; and under the root's recovery (see
    :class:`lampdist.Recovery`), hold (a rank was lost: abandon the work in flight and wait)
    and rejoin (open the clique of the new generation)."""

    TRAIN = "train"
    VALID = "valid"
    CHECKPOINT = "checkpoint"
    STOP = "stop"
    HOLD = "hold"
    REJOIN = "rejoin"

    @property
    def phase(self) -> Phase:
        """The phase a rank is in while it carries this command out: the kind's value
        (``'recover'`` for HOLD and REJOIN)."""
        if self in (CommandKind.HOLD, CommandKind.REJOIN):
            return "recover"
        return self.value  # type: ignore[no-any-return]  # every other value is a Phase


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"Command.{name} must be an integer >= 0, got {value!r}")


def _check_segment(kind: CommandKind, segment: object) -> None:
    if kind is not CommandKind.TRAIN:
        raise ConfigError("only a TRAIN command carries a segment")
    if (
        not isinstance(segment, tuple)
        or len(segment) != 3
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in segment)
        or not 0 <= segment[0] < segment[1]
        or segment[2] < 1
    ):
        raise ConfigError(
            "Command.segment must be (first, stop, length) with 0 <= first < stop and "
            f"length >= 1, got {segment!r}"
        )


@attrs.frozen(kw_only=True)
class Command:
    """One instruction from the root to every follower.

    ``epoch`` is the epoch the pass belongs to, ``pass_index`` counts passes from 0 and
    increases over the run. ``lr_factor`` is the learning-rate factor of a training pass (the
    followers stepping on the root do not step an optimizer, the others scale their learning
    rates by it). CHECKPOINT comes before the root checkpoints an epoch: every rank hands the
    root what it holds of the checkpoint (its slice of a sharded optimizer state, its place in
    its training data, its RNG states). ``error`` is set only on a STOP that aborts the run:
    followers then raise :class:`lampdist.RankFailed` (``rank=0``) with it. ``state`` is set
    only on a STOP that ends the run in order: the root's final :class:`lampdist.LoopState`,
    which every follower returns.

    ``validation_set`` names the validation set a VALID pass runs over (``None``: the one
    source); with ``share_result`` the root's result of that pass goes to every rank (an
    evaluation-only run, :func:`lampdist.evaluate`).

    HOLD tells the survivors of a lost rank to abandon the work in flight and wait up to
    ``timeout`` seconds for the root's next command; its ``error`` says which rank was lost
    and why. REJOIN carries the ``clique_id`` of the clique's next generation, which every
    rank opens before the root redoes the pass in flight.

    ``segment`` (a TRAIN under ``Recovery(snapshot_every_steps=length)``): ``(first, stop,
    length)``, the pass's steps ``[first, stop)`` only, one of its segments of ``length`` steps,
    which goes on from the segment before it (``None``: the whole pass).

    Raises :class:`lampdist.ConfigError` for a negative count, a non-finite ``lr_factor``, an
    ``error`` on anything but STOP and HOLD, a ``validation_set`` or ``share_result`` on
    anything but VALID, a ``clique_id`` on anything but REJOIN (which needs one), a
    ``timeout`` on anything but HOLD and a ``state`` on anything but a STOP without an
    ``error``.
    """

    kind: CommandKind
    epoch: int
    pass_index: int
    lr_factor: float | None = None
    error: str | None = None
    clique_id: CliqueId | None = None
    timeout: float | None = None
    state: LoopState | None = None
    validation_set: str | None = None
    share_result: bool = False
    segment: tuple[int, int, int] | None = None

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
            if self.kind not in (CommandKind.STOP, CommandKind.HOLD):
                raise ConfigError("only a STOP or HOLD command carries an error")
        if self.validation_set is not None or self.share_result:
            if self.kind is not CommandKind.VALID:
                raise ConfigError("only a VALID command carries a validation_set or share_result")
            if self.validation_set is not None and not isinstance(self.validation_set, str):
                raise ConfigError(
                    f"Command.validation_set must be a string, got {self.validation_set!r}"
                )
        if self.segment is not None:
            _check_segment(self.kind, self.segment)
        if (self.clique_id is not None) != (self.kind is CommandKind.REJOIN):
            raise ConfigError("a REJOIN command, and only it, carries a clique_id")
        if self.timeout is not None:
            if self.kind is not CommandKind.HOLD:
                raise ConfigError("only a HOLD command carries a timeout")
            if (
                not isinstance(self.timeout, int | float)
                or isinstance(self.timeout, bool)
                or not self.timeout > 0
            ):
                raise ConfigError(f"Command.timeout must be > 0 seconds, got {self.timeout!r}")
        if self.state is not None and (
            self.kind is not CommandKind.STOP
            or self.error is not None
            or not isinstance(self.state, LoopState)
        ):
            raise ConfigError("only a STOP command without an error carries a LoopState")

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
        if self.clique_id is not None:
            data["clique_id"] = self.clique_id.to_json()
        if self.timeout is not None:
            data["timeout"] = float(self.timeout)
        if self.state is not None:
            data["state"] = _spell_non_finite(loop_state_to_json(self.state))
        if self.validation_set is not None:
            data["validation_set"] = self.validation_set
        if self.share_result:
            data["share_result"] = True
        if self.segment is not None:
            data["segment"] = list(self.segment)
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
        timeout, clique = data.get("timeout"), data.get("clique_id")
        if timeout is not None and not isinstance(timeout, int | float):
            raise ProtocolError(f"a command's 'timeout' must be a number, got {timeout!r}")
        clique_id = None if clique is None else CliqueId.from_json(clique)
        state = _state_from_json(data.get("state"))
        validation_set, share = data.get("validation_set"), data.get("share_result", False)
        if validation_set is not None and (
            not isinstance(validation_set, str) or len(validation_set) > MAX_TEXT_CHARS
        ):
            raise ProtocolError("a command's 'validation_set' must be a string of bounded length")
        if not isinstance(share, bool):
            raise ProtocolError(f"a command's 'share_result' must be a boolean, got {share!r}")
        segment = data.get("segment")
        if segment is not None:
            if not isinstance(segment, list) or len(segment) != 3:
                raise ProtocolError(
                    f"a command's 'segment' must be [first, stop, length], got {segment!r}"
                )
            segment = tuple(segment)
        try:
            return cls(
                kind=kind,
                epoch=epoch,
                pass_index=pass_index,
                lr_factor=lr_factor,
                error=error,
                clique_id=clique_id,
                timeout=timeout,
                state=state,
                validation_set=validation_set,
                share_result=share,
                segment=segment,
            )
        except ConfigError as exc:
            raise ProtocolError(f"invalid command: {exc.message}") from None


_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
"""How a STOP's state spells the floats that JSON lacks (a loss may be NaN or infinite); its
JSON has no other string values."""


def _spell_non_finite(value: Any) -> Any:
    """``value`` with every non-finite float spelled as a key of :data:`_NON_FINITE`."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _spell_non_finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_spell_non_finite(item) for item in value]
    return value


def _read_non_finite(value: Any) -> Any:
    """:func:`_spell_non_finite` undone."""
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, dict):
        return {key: _read_non_finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_read_non_finite(item) for item in value]
    return value


def _state_from_json(data: object) -> LoopState | None:
    """A STOP's ``state`` field parsed (``None`` when absent); raises
    :class:`lampdist.ProtocolError` for one :func:`loop_state_to_json` did not write."""
    if data is None:
        return None
    try:
        return loop_state_from_json(_read_non_finite(data))
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise ProtocolError(f"a STOP's 'state' is no loop state ({exc!r})") from None


def clip_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, marked when cut."""
    if len(text) <= limit:
        return text
    marker = " ... [cut]"
    return text[: limit - len(marker)] + marker
