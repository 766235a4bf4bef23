"""Every entry point that takes a deadline defaults to the same one as :class:`Timeouts`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import pytest

import lampdist
from lampdist import control
from lampdist.clique import in_process, open_clique
from lampdist.launch import PortExchange

TIMEOUTS = lampdist.Timeouts()


def default(function: Callable[..., Any], name: str) -> object:
    return inspect.signature(function).parameters[name].default


@pytest.mark.parametrize(
    ("function", "parameter", "kind"),
    [
        (open_clique, "setup_timeout", "setup"),
        (open_clique, "collective_timeout", "collective"),
        (in_process, "collective_timeout", "collective"),
        (control.tcp_follower, "join_timeout", "join"),
        (control.local_channels, "join_timeout", "join"),
    ],
)
def test_factories_default_to_the_timeouts_of_a_run(
    function: Callable[..., Any], parameter: str, kind: str
) -> None:
    assert default(function, parameter) == getattr(TIMEOUTS, kind)


def test_the_join_default_is_the_channels_and_the_port_exchanges() -> None:
    assert TIMEOUTS.join == control.DEFAULT_JOIN_TIMEOUT
    assert attrs.fields(PortExchange).timeout.default == TIMEOUTS.join


def test_the_defaults_are_the_documented_ones() -> None:
    assert (TIMEOUTS.join, TIMEOUTS.setup, TIMEOUTS.collective, TIMEOUTS.stop) == (
        300.0,
        300.0,
        600.0,
        30.0,
    )
