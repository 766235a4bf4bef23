"""``lampdist checkpoint ls`` and ``lampdist checkpoint verify``, on a directory and on a real S3
endpoint (moto's server, see tests/checkpoint/s3_server.py)."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lampdist._checkpoint import write_checkpoint
from lampdist._checkpoint._rng import capture_rng_states
from lampdist.cli import main

from ..checkpoint.checkpoint_writer import expected_state
from ..checkpoint.s3_server import S3Server, set_environment, start_server


def write_epochs(directory: Path, *epochs: int) -> None:
    for epoch in epochs:
        state, lr_state = expected_state(epoch)
        write_checkpoint(
            directory, state, lr_state, capture_rng_states(), keep=5, check=lambda: None
        )


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_ls_lists_the_checkpoints_newest_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_epochs(tmp_path, 1, 2, 2)
    (tmp_path / ".tmp-epoch-000003-abcd").mkdir()  # scratch: not a checkpoint
    assert main(["checkpoint", "ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "EPOCH", "SIZE", "(MB)", "VERIFIED", "PROBLEM"]
    rows = [line.split() for line in lines[1:]]
    assert [(row[0], row[1], row[3]) for row in rows] == [
        ("epoch-000002.1", "2", "-"),  # it superseded epoch-000002
        ("epoch-000001", "1", "-"),
    ]
    assert all(float(row[2]) >= 0 for row in rows)


def test_ls_verify_flags_a_damaged_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_epochs(tmp_path, 1, 2)
    damage(tmp_path / "epoch-000002" / "optimizer.tensors")
    assert main(["checkpoint", "ls", "--verify", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["epoch-000002", "2", lines[1].split()[2], "no"]
    assert "optimizer.tensors" in lines[1]
    assert lines[2].split()[3] == "yes"


def test_verify_passes_intact_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_epochs(tmp_path, 1, 2)
    assert main(["checkpoint", "verify", str(tmp_path)]) == 0
    assert "2 checkpoints verified" in capsys.readouterr().out


def test_verify_fails_naming_the_damaged_checkpoint_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_epochs(tmp_path, 1, 2)
    damage(tmp_path / "epoch-000001" / "state.json")
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert f"DAMAGED  {tmp_path / 'epoch-000001'}: state.json" in captured.out
    assert f"ok       {tmp_path / 'epoch-000002'}" in captured.out
    assert "1 of 2 checkpoints damaged: epoch-000001" in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["checkpoint", "verify"],
        ["checkpoint", "verify", "no/such/directory"],
        ["checkpoint", "ls", ".", "--option", "no-equals-sign"],
        ["checkpoint", "consolidate", ".", "model.pt", "-o", "no-equals-sign"],
    ],
    ids=["no-location", "no-directory", "bad-option", "bad-consolidate-option"],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage: lampdist checkpoint" in capsys.readouterr().err


def test_the_actions_help_imports_no_torch() -> None:
    script = (
        "import sys, lampdist.cli\n"
        "try:\n    raise SystemExit(lampdist.cli.main(sys.argv[1:]))\n"
        "finally:\n    print('imported:', *sorted(sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "checkpoint", "verify", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: lampdist checkpoint verify" in done.stdout
    imported = done.stderr.rsplit("imported:", 1)[1].split()
    assert [name for name in imported if name.split(".")[0] == "torch"] == []


# ---------------------------------------------------------------------------------------------
# on S3


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    server = start_server()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    set_environment(monkeypatch, s3_server)
    return f"s3://{s3_server.create_bucket()}/run-{secrets.token_hex(3)}"


def test_verify_on_s3_fails_naming_the_damaged_part(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import obstore
    from obstore.store import from_url

    from lampdist._checkpoint import write_to_store

    for epoch in (1, 2):
        state, lr_state = expected_state(epoch)
        write_to_store(
            s3_url, state, lr_state, capture_rng_states(), keep=3, check=lambda: None,
            options=None,
        )  # fmt: skip
    assert main(["checkpoint", "verify", s3_url]) == 0
    assert main(["checkpoint", "ls", s3_url]) == 0
    out = capsys.readouterr().out
    assert "epoch-000002" in out and "epoch-000001" in out

    store = from_url(s3_url)
    key = "epoch-000002/model.tensors"
    data = bytes(obstore.get(store, key).bytes())
    obstore.put(store, key, data[: len(data) // 2])  # truncated
    assert main(["checkpoint", "verify", s3_url]) == 1
    captured = capsys.readouterr()
    assert f"DAMAGED  {s3_url}/epoch-000002: model.tensors has" in captured.out
    assert f"ok       {s3_url}/epoch-000001" in captured.out
    assert main(["checkpoint", "ls", "--verify", s3_url]) == 0
    assert "model.tensors" in capsys.readouterr().out


def test_consolidate_reads_the_newest_checkpoint_of_a_url(s3_url: str, tmp_path: Path) -> None:
    import torch

    from lampdist._checkpoint import write_to_store

    state, lr_state = expected_state(3)
    write_to_store(
        s3_url, state, lr_state, capture_rng_states(), keep=3, check=lambda: None, options=None
    )
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "consolidate", s3_url, str(out)]) == 0
    model = torch.load(out, weights_only=True)
    assert model.keys() == state.model_state.keys()
    assert all(torch.equal(model[name], state.model_state[name]) for name in model)


def test_consolidate_takes_the_store_options_as_ls_and_verify_do(
    s3_url: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-o KEY=VALUE`` reaches the store: here the endpoint that no variable names."""
    import torch

    from lampdist._checkpoint import write_to_store

    state, lr_state = expected_state(2)
    write_to_store(
        s3_url, state, lr_state, capture_rng_states(), keep=3, check=lambda: None, options=None
    )
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    options = ["-o", f"endpoint={s3_server.endpoint}", "--option", "allow_http=true"]
    for action in (["ls", s3_url], ["verify", s3_url]):
        assert main(["checkpoint", *action, *options]) == 0
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "consolidate", s3_url, str(out), *options]) == 0
    model = torch.load(out, weights_only=True)
    assert model.keys() == state.model_state.keys()
    assert all(torch.equal(model[name], state.model_state[name]) for name in model)


def test_a_store_that_cannot_be_reached_exits_1(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ..checkpoint.s3_server import free_port

    options = [f"endpoint=http://127.0.0.1:{free_port()}", "max_retries=0"]
    argv = ["checkpoint", "verify", s3_url, *(f"--option={option}" for option in options)]
    assert main(argv) == 1
    assert f"could not list the checkpoints in {s3_url}" in capsys.readouterr().err
