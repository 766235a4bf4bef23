"""The examples run as documented: in-process for the anyio script and the service (whose
jobs with followers start follower processes of their own), under torchrun (as a
subprocess, two CPU ranks) for the torchrun script."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest

ROOT_DIR = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT_DIR / "examples"


def load(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_anyio_script_trains_and_the_loss_falls() -> None:
    example = load("anyio_script")
    with anyio.fail_after(60):
        state = await example.main(epochs=3)
    losses = [point.validation_loss for point in state.learning_curve]
    assert len(losses) == 3
    assert losses[-1] < losses[0] / 2


def _errors_first(stderr: str) -> str:
    """Every line that names an error (the first failing rank's is the cause), then the tail."""
    named = [line for line in stderr.splitlines() if "Error" in line or "error" in line]
    return "\n".join(named[:40]) + "\n...\n" + stderr[-3000:]


def test_torchrun_script_under_torchrun(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LAMPDIST_SECRET": "example-secret",
        # no LAMPDIST_PORT: the root's free port travels through torchrun's store
        "PYTHONPATH": os.pathsep.join([str(ROOT_DIR / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLES / "torchrun_script.py"), "--epochs", "3"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, _errors_first(done.stderr)
    results = {r["rank"]: r for r in map(json.loads, _json_lines(done.stdout))}
    assert sorted(results) == [0, 1], done.stdout
    assert results[0]["checksum"] == results[1]["checksum"]  # every rank ends with the weights
    losses = results[0]["validation_losses"]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2
    assert results[1]["validation_losses"] == losses  # every rank returns the final state
    assert done.stderr.count("epoch 0: training loss") == 1  # the progress: the root's only


def test_hf_causal_lm_under_torchrun(tmp_path: Path) -> None:
    """The transformers GPT-2 of examples/hf_causal_lm.py, on two CPU ranks: both end with the
    same weights and the same losses of both validation sets, the held-out loss falls from
    the validation before training, and the exported model loads with ``from_pretrained``
    holding those weights."""
    env = {
        **os.environ,
        "LAMPDIST_SECRET": "example-secret",
        "PYTHONPATH": os.pathsep.join([str(ROOT_DIR / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLES / "hf_causal_lm.py"), "--epochs", "2"]
    command += ["--out", str(tmp_path / "run")]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, _errors_first(done.stderr)
    results = {r["rank"]: r for r in map(json.loads, _json_lines(done.stdout))}
    assert sorted(results) == [0, 1], done.stdout
    assert results[0] == {**results[1], "rank": 0}  # the same weights and losses everywhere
    assert results[0]["val_loss"] < results[0]["first_val_loss"] - 1.0
    assert "training, the mean of steps 6-10" in done.stderr  # log_every_n_steps=5
    # the root's export of the best model, which every rank holds, loads with transformers
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    checksum = float(sum(t.double().sum() for t in exported.state_dict().values()))
    assert checksum == pytest.approx(results[0]["checksum"], rel=1e-12)


def _json_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{")]


@pytest.fixture
def service() -> ModuleType:
    pytest.importorskip("starlette")
    return load("job_service")


async def _client_for(service: ModuleType) -> tuple[Any, httpx.AsyncClient]:
    app = service.app
    transport = httpx.ASGITransport(app=app)
    return app, httpx.AsyncClient(transport=transport, base_url="http://service")


async def test_job_service_streams_a_job_to_its_end(service: ModuleType) -> None:
    app, client = await _client_for(service)
    with anyio.fail_after(60):
        async with app.router.lifespan_context(app), client:
            started = await client.post("/jobs", json={"epochs": 2})
            assert started.status_code == 201
            job = started.json()["id"]
            events = await client.get(f"/jobs/{job}/events")  # ends with the job
            lines = [json.loads(line) for line in events.text.splitlines()]
            assert [(e["epoch"], e["kind"]) for e in lines[:-1]] == [
                (0, "train"),
                (0, "valid"),
                (1, "train"),
                (1, "valid"),
            ]
            assert lines[-1] == {"status": "done"}
            assert (await client.get(f"/jobs/{job}")).json()["status"] == "done"
            assert (await client.get("/jobs/99")).status_code == 404
            assert (await client.post("/jobs", json={"epochs": 0})).status_code == 422


async def test_job_service_cancels_a_job_and_runs_the_next(service: ModuleType) -> None:
    app, client = await _client_for(service)
    with anyio.fail_after(60):
        async with app.router.lifespan_context(app), client:
            job = (await client.post("/jobs", json={"epochs": 100_000})).json()["id"]
            while (await client.get(f"/jobs/{job}")).json()["last"] is None:  # noqa: ASYNC110
                await anyio.sleep(0.05)  # a client polls the service as it would over HTTP
            cancelled = await client.delete(f"/jobs/{job}")  # answers once every rank stopped
            assert cancelled.json()["status"] == "cancelled"
            events = (await client.get(f"/jobs/{job}/events")).text.splitlines()
            assert json.loads(events[-1]) == {"status": "cancelled"}
            assert len(events) < 100_000
            # the cancelled job released its ranks and process group: the next one runs
            second = (await client.post("/jobs", json={"epochs": 1})).json()["id"]
            await client.get(f"/jobs/{second}/events")
            assert (await client.get(f"/jobs/{second}")).json()["status"] == "done"


async def test_job_service_stops_a_job_after_its_epoch(service: ModuleType) -> None:
    app, client = await _client_for(service)
    with anyio.fail_after(60):
        async with app.router.lifespan_context(app), client:
            job = (await client.post("/jobs", json={"epochs": 100_000})).json()["id"]
            while (await client.get(f"/jobs/{job}")).json()["last"] is None:  # noqa: ASYNC110
                await anyio.sleep(0.05)
            stopped = await client.post(f"/jobs/{job}/stop")  # answers once every rank stopped
            assert stopped.json()["status"] == "stopped"
            lines = [
                json.loads(line)
                for line in (await client.get(f"/jobs/{job}/events")).text.splitlines()
            ]
            assert lines[-1] == {"status": "stopped"}
            passes = [(e["epoch"], e["kind"]) for e in lines[:-1]]
            # the epoch in progress ended whole: trained and validated, nothing cut short
            last_epoch = passes[-1][0]
            assert passes[-2:] == [(last_epoch, "train"), (last_epoch, "valid")]
            assert last_epoch < 100_000 - 1
            assert (await client.post("/jobs/99/stop")).status_code == 404


async def _stop_and_read(client: httpx.AsyncClient, job: int) -> list[dict[str, Any]]:
    """Stop ``job`` (the answer comes once every rank stopped): its events, checked to end
    ``stopped``, with no error and every epoch whole."""
    stopped = (await client.post(f"/jobs/{job}/stop")).json()
    assert (stopped["status"], stopped["error"]) == ("stopped", None), stopped
    lines = [
        json.loads(line) for line in (await client.get(f"/jobs/{job}/events")).text.splitlines()
    ]
    assert lines[-1] == {"status": "stopped"}, lines[-3:]
    passes = _passes(lines)
    assert passes == _every_pass(len(passes) // 2), passes  # the epoch in progress ended whole
    return lines


async def test_job_service_stops_a_job_stopped_whenever_the_stop_comes(
    service: ModuleType,
) -> None:
    """A stop before training (the ranks joining, opening their clique, agreeing: nothing to
    finish, the run is abandoned at once) ends the job ``stopped``, as one in training does,
    not ``failed``. The stops come at a spread of moments: as the job starts, a few
    milliseconds into it, and after its first pass. Each must end ``stopped``, whatever it
    met; the spread meets both sides of the first pass."""
    app, client = await _client_for(service)
    trained: list[int] = []
    with anyio.fail_after(120):
        async with app.router.lifespan_context(app), client:
            for delay in (0, 0, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, None):  # None: trained
                job = (await client.post("/jobs", json={"epochs": 100_000})).json()["id"]
                if delay is None:
                    await _running(client, job)
                else:
                    await anyio.sleep(delay)  # where the stop lands, not what it must do
                trained.append(len(_passes(await _stop_and_read(client, job))))
    assert 0 in trained and trained[-1] > 0, trained


@pytest.mark.slow
async def test_job_service_stops_a_job_with_followers_stopped_whenever_the_stop_comes(
    service: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, with a follower process: a stop while the process starts (the root waits for
    it to join), once it has joined (the root opens the clique or agrees, or has just begun
    to train), and in training. The job ends ``stopped`` each time, its follower ended and
    waited for, and not started again."""
    caplog.set_level(logging.INFO, logger="lampdist.control")

    def joined() -> bool:  # the root's record of the follower's join
        return any(r.getMessage() == "rank 1 joined the control channel" for r in caplog.records)

    app, client = await _client_for(service)
    with anyio.fail_after(180):
        async with app.router.lifespan_context(app), client:
            for moment in ("starting", "joined", "trained"):
                caplog.clear()
                body = {"epochs": 100_000, "followers": 1}
                job = (await client.post("/jobs", json=body)).json()["id"]
                if moment == "starting":
                    while not (await client.get(f"/jobs/{job}")).json()["pids"]:  # noqa: ASYNC110
                        await anyio.sleep(0.01)  # a client polls the service over HTTP
                elif moment == "joined":
                    while not joined():  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                else:
                    await _running(client, job)
                lines = await _stop_and_read(client, job)
                if moment != "joined":  # the follower takes seconds to start; then it trains
                    assert bool(_passes(lines)) == (moment == "trained"), (moment, lines)
                summary = (await client.get(f"/jobs/{job}")).json()
                assert summary["restarts"] == 0, (moment, summary, lines)
                assert all(_gone(pid) for pid in summary["pids"].values()), (moment, summary)


def _passes(lines: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(e["epoch"], e["kind"]) for e in lines if "epoch" in e]


def _every_pass(epochs: int) -> list[tuple[int, str]]:
    return [(epoch, kind) for epoch in range(epochs) for kind in ("train", "valid")]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended and been waited for (no zombie left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _running(client: httpx.AsyncClient, job: int) -> dict[str, Any]:
    """The job's summary once its first pass has ended (every follower joined by then)."""
    while (summary := (await client.get(f"/jobs/{job}")).json())["last"] is None:
        assert summary["status"] == "running", summary
        await anyio.sleep(0.05)
    return summary  # type: ignore[no-any-return]


async def test_job_service_runs_a_job_with_follower_processes(service: ModuleType) -> None:
    app, client = await _client_for(service)
    with anyio.fail_after(60):
        async with app.router.lifespan_context(app), client:
            started = await client.post("/jobs", json={"epochs": 2, "followers": 2})
            assert started.status_code == 201
            assert started.json()["followers"] == 2
            job = started.json()["id"]
            lines = [
                json.loads(line)
                for line in (await client.get(f"/jobs/{job}/events")).text.splitlines()
            ]
            assert _passes(lines) == _every_pass(2)
            assert lines[-1] == {"status": "done"}
            summary = (await client.get(f"/jobs/{job}")).json()
            assert summary["status"] == "done" and summary["restarts"] == 0, summary
            assert sorted(summary["pids"]) == ["1", "2"]
            assert all(_gone(pid) for pid in summary["pids"].values())  # waited for
            for bad in (0, -1, 9, "2", 1.5, True):
                answer = await client.post("/jobs", json={"epochs": 1, "followers": bad})
                assert answer.status_code == 422, bad


async def test_job_service_restarts_a_killed_follower_and_the_job_goes_on(
    service: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower SIGKILLed in the middle of the job: the service starts it again, the root
    takes it back in and redoes the pass in flight, and the job ends done."""
    monkeypatch.setenv("JOB_SERVICE_BATCH_SECONDS", "0.01")  # a job of a few seconds
    epochs = 30
    app, client = await _client_for(service)
    with anyio.fail_after(90):
        async with app.router.lifespan_context(app), client:
            job = (await client.post("/jobs", json={"epochs": epochs, "followers": 1})).json()
            killed = (await _running(client, job["id"]))["pids"]["1"]
            os.kill(killed, signal.SIGKILL)
            lines = [
                json.loads(line)
                for line in (await client.get(f"/jobs/{job['id']}/events")).text.splitlines()
            ]
            summary = (await client.get(f"/jobs/{job['id']}")).json()
    assert lines[-1] == {"status": "done"}, lines[-3:]
    restarted = [e["restarted"] for e in lines if "restarted" in e]
    assert restarted == [{"rank": 1, "returncode": -signal.SIGKILL, "restarts": 1}]
    (recovered,) = [e["recovered"] for e in lines if "recovered" in e]
    assert recovered["ranks"] == [1] and recovered["recoveries"] == 1, recovered
    assert 0 < recovered["seconds"] < 60
    assert recovered["phase"] in ("train", "checkpoint", "valid")
    assert lines.index({"restarted": restarted[0]}) < lines.index({"recovered": recovered})
    # every pass ended, once, but for the one in flight, which may end twice (a loss in the
    # snapshot after it redoes it)
    passes = _passes(lines)
    assert list(dict.fromkeys(passes)) == _every_pass(epochs)
    assert len(passes) <= 2 * epochs + 1
    assert summary["status"] == "done" and summary["restarts"] == 1, summary
    replacement = summary["pids"]["1"]
    assert replacement != killed
    assert _gone(killed) and _gone(replacement)


async def test_job_service_cancels_a_job_with_followers_and_ends_their_processes(
    service: ModuleType,
) -> None:
    """Cancelling a job ends its follower processes before it answers; so does the
    service's own shutdown."""
    app, client = await _client_for(service)
    with anyio.fail_after(90):
        async with app.router.lifespan_context(app), client:
            job = (await client.post("/jobs", json={"epochs": 100_000, "followers": 2})).json()
            pids = list((await _running(client, job["id"]))["pids"].values())
            assert len(pids) == 2 and not any(_gone(pid) for pid in pids)
            cancelled = await client.delete(f"/jobs/{job['id']}")
            assert cancelled.json()["status"] == "cancelled"
            assert cancelled.json()["restarts"] == 0  # a follower ended by its job is not lost
            assert [pid for pid in pids if not _gone(pid)] == []
            # a job still running when the service shuts down
            job = (await client.post("/jobs", json={"epochs": 100_000, "followers": 1})).json()
            last = list((await _running(client, job["id"]))["pids"].values())
        assert [pid for pid in last if not _gone(pid)] == []


def test_torchrun_script_stops_in_order_on_ctrl_c(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the job (a terminal's process group, or torchrun
    forwarding it): the run ends in order on every rank, with no traceback."""
    ports = [_free_port(), _free_port()]
    base = {
        **os.environ,
        "LAMPDIST_SECRET": "example-secret",
        "PYTHONPATH": os.pathsep.join([str(ROOT_DIR / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(ports[0]),
        "LAMPDIST_PORT": str(ports[1]),
    }
    command = [sys.executable, str(EXAMPLES / "torchrun_script.py"), "--epochs", "100000"]
    ranks: list[subprocess.Popen[str]] = []
    try:
        for rank in range(2):
            ranks.append(
                subprocess.Popen(
                    command,
                    cwd=tmp_path,
                    env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    process_group=ranks[0].pid if ranks else 0,  # one group, as in a terminal
                )
            )
        root_err: list[str] = []
        reader = threading.Thread(target=_read_into, args=(ranks[0], root_err), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any("training loss" in line for line in root_err):  # an epoch trained
            assert all(process.poll() is None for process in ranks), "a rank ended early"
            assert time.monotonic() < deadline, "no epoch trained within 120 s"
            time.sleep(0.05)
        os.killpg(ranks[0].pid, signal.SIGINT)
        ranks[0].wait(timeout=60)
        reader.join(timeout=10)
        errors = ["".join(root_err), ranks[1].communicate(timeout=60)[1]]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert ranks[0].returncode == 128 + signal.SIGINT, errors[0]
    assert ranks[1].returncode == 0, errors[1]
    assert "Traceback" not in errors[0] + errors[1], errors
    assert errors[0].strip().splitlines()[-1].startswith("Interrupted: rank 0, phase 'stop'")


def _read_into(process: subprocess.Popen[str], lines: list[str]) -> None:
    """Append ``process``'s stderr lines to ``lines`` as they come."""
    assert process.stderr is not None
    for line in process.stderr:
        lines.append(line)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
