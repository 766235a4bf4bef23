"""Developer sessions: ``nox -s tests lint typecheck docs bench slow mutants``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"  # the CPU build; a looser spec pulls a multi-GB CUDA build


def install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (the README's test command), slow tests excluded."""
    install(session, "test")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """The fault-injection and soak tests marked ``slow``."""
    install(session, "test")
    # One test at a time: the fault matrix times how fast ranks notice a fault.
    session.run("python", "-m", "pytest", "-m", "slow", "--run-slow", "-n", "0", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """Hand-written mutants of the central paths; every one must make its tests fail."""
    install(session, "test")
    session.run("python", "tests/mutants.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over src and tests."""
    install(session, "dev")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs with warnings as errors."""
    install(session, "docs,demo")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks' short CPU configuration; pass arguments after ``--``."""
    install(session, "test")
    session.run("python", "benchmarks/throughput.py", *(session.posargs or ["--mode", "cpu"]))


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos run (benchmarks/chaos.py): about 20 faults; arguments after ``--`` override.

    A root and followers over TCP on 127.0.0.1, killed, stopped, signalled and cut off at
    random moments of seed 1; ``-- --seed 7 --followers 3 --json chaos.json`` for others.
    """
    install(session, "test")
    session.run("python", "benchmarks/chaos.py", "--faults", "20", "--seed", "1", *session.posargs)
