"""The throughput harness's CPU mode, run as CI runs it: real processes, Gloo, a few steps."""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
THROUGHPUT = BENCHMARKS / "throughput.py"
RUN_TIMEOUT = 120


def run_harness(*args: str, json_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(THROUGHPUT), "--mode", "cpu", "--steps", "5", "--warmup", "2"]
    if json_path is not None:
        command += ["--json", str(json_path)]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )


@pytest.fixture
def throughput(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("throughput")


@pytest.mark.slow
def test_cpu_mode_measures_every_configuration(tmp_path: Path) -> None:
    result = run_harness(json_path=tmp_path / "result.json")
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads((tmp_path / "result.json").read_text())
    configs = report["configs"]
    assert list(configs) == ["single", "ddp", "lampdist", "lampdist-every", "lampdist-sharded"]
    assert report["meta"]["nranks"] == 2
    assert report["meta"]["parameters"] > 0
    for name, entry in configs.items():
        assert entry["samples_per_s"] > 0, name
        assert len(entry["peak_memory_bytes"]) == entry["ranks"], name
        assert all(peak > 0 for peak in entry["peak_memory_bytes"]), name
        assert name in result.stdout
    assert configs["single"]["ranks"] == 1
    assert configs["ddp"]["ranks"] == configs["lampdist"]["ranks"] == 2
    assert configs["lampdist-every"]["ranks"] == 2
    assert configs["lampdist-every"]["kwargs"] == {"step_on": "every_rank"}
    assert configs["lampdist-sharded"]["kwargs"] == {"step_on": "sharded"}
    # The benchmark's AdamW holds two values per parameter; sharded, each rank half of them.
    parameters = report["meta"]["parameters"]
    assert configs["lampdist-every"]["optimizer_state_bytes"][0] >= 8 * parameters
    sharded_state = configs["lampdist-sharded"]["optimizer_state_bytes"]
    assert sum(sharded_state) <= configs["lampdist-every"]["optimizer_state_bytes"][0] + 64
    assert max(sharded_state) < 0.6 * configs["lampdist-every"]["optimizer_state_bytes"][0]
    # Unsharded, every rank holds the whole parameters and gradients (fp32).
    for name, entry in configs.items():
        assert entry["parameter_bytes"] == [4 * parameters] * entry["ranks"], name
        assert entry["gradient_bytes"] == [4 * parameters] * entry["ranks"], name
    for name in ("lampdist", "lampdist-every", "lampdist-sharded"):
        assert configs[name]["scaling_efficiency"] > 0, name
        assert configs[name]["vs_ddp"] > 0, name
    assert configs["single"]["scaling_efficiency"] is None
    assert "samples/s" in result.stdout


def test_fsdp2_plain_and_through_lampdist_each_hold_half_on_two_ranks(tmp_path: Path) -> None:
    """``fsdp`` (a plain loop over torch's FSDP2) and ``lampdist-fsdp`` (``step_on="fsdp"``)
    on 2 Gloo ranks: each rank holds half of the parameters, of their gradients and of the
    optimizer state (the small model's layers split evenly in two)."""
    result = run_harness("--configs", "fsdp,lampdist-fsdp", json_path=tmp_path / "fsdp.json")
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads((tmp_path / "fsdp.json").read_text())
    configs = report["configs"]
    assert list(configs) == ["fsdp", "lampdist-fsdp"]
    assert configs["fsdp"]["kind"] == "fsdp"
    assert configs["lampdist-fsdp"]["kind"] == "lampdist"
    assert configs["lampdist-fsdp"]["kwargs"] == {"step_on": "fsdp", "fsdp_blocks": True}
    parameters = report["meta"]["parameters"]
    for name, entry in configs.items():
        assert entry["ranks"] == 2, name
        assert entry["samples_per_s"] > 0, name
        assert all(peak > 0 for peak in entry["peak_memory_bytes"]), name
        assert entry["parameter_bytes"] == [4 * parameters // 2] * 2, name
        assert entry["gradient_bytes"] == [4 * parameters // 2] * 2, name
        # AdamW's two values per element of the rank's shard, and a step count per tensor
        for state in entry["optimizer_state_bytes"]:
            assert 8 * parameters // 2 <= state <= 8 * parameters // 2 + 1024, name
        assert name in result.stdout
    assert "params / grads / optimizer" in result.stdout


def test_one_rank_compares_lampdist_with_the_plain_loop(tmp_path: Path) -> None:
    result = run_harness(
        "--nranks", "1", "--configs", "single", "lampdist", json_path=tmp_path / "one.json"
    )
    assert result.returncode == 0, result.stderr
    configs = json.loads((tmp_path / "one.json").read_text())["configs"]
    assert configs["lampdist"]["ranks"] == 1
    assert configs["lampdist"]["samples_per_s"] > 0
    assert configs["lampdist"]["scaling_efficiency"] > 0


def test_a_failing_configuration_fails_the_run_with_its_output() -> None:
    result = run_harness("--nranks", "1", "--configs", "ddp-broken=no_such_option:1")
    assert result.returncode == 1
    assert "ddp-broken: rank 0 exited" in result.stderr
    assert "no_such_option" in result.stderr


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("_launch")


def test_a_rendezvous_port_taken_before_the_ranks_bind_it_is_tried_again_on_a_new_one(
    launcher: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The port is free when chosen but another process may bind it before rank 0 does (CI
    runs many tests at once): the launcher starts the configuration again on a new port."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen = [taken.getsockname()[1]]
    real_free_port = launcher.free_port

    def first_the_taken_one() -> int:
        return chosen.pop() if chosen else int(real_free_port())

    monkeypatch.setattr(launcher, "free_port", first_the_taken_one)
    settings = launcher.Settings(
        device_type="cpu", model="small", nranks=1, steps=2, warmup=1, threads=1, timeout=60.0
    )
    config = launcher.Config(name="ddp", kind="ddp")
    with taken:
        results = launcher.launch(config, settings, tmp_path / "ddp")
    assert [result.rank for result in results] == [0]
    assert "EADDRINUSE" in (tmp_path / "ddp" / "rank0.log").read_text()
    # The new port is free when chosen too, but under CI's parallel tests another process
    # may take it as well: the results come from the first later attempt that got its port.
    later = [tmp_path / f"ddp-{n}" for n in range(2, launcher.PORT_ATTEMPTS + 1)]
    finished = [where for where in later if (where / "rank0.json").exists()]
    assert finished, [where.name for where in later if where.exists()]
    for where in later[: later.index(finished[0])]:
        assert "EADDRINUSE" in (where / "rank0.log").read_text()


def test_a_failure_other_than_a_taken_port_is_not_tried_again(
    launcher: ModuleType, tmp_path: Path
) -> None:
    settings = launcher.Settings(
        device_type="cpu", model="small", nranks=1, steps=2, warmup=1, threads=1, timeout=60.0
    )
    config = launcher.Config(name="ddp", kind="ddp", kwargs={"no_such_option": 1})
    with pytest.raises(launcher.BenchmarkError, match="no_such_option"):
        launcher.launch(config, settings, tmp_path / "ddp")
    assert not (tmp_path / "ddp-2").exists()


def test_configs_parse_names_and_variants(throughput: ModuleType) -> None:
    configs = throughput.parse_configs(
        [
            "single,ddp,lampdist-every",
            "lampdist-ar=step_on:every_rank,max_grad_norm:1.5,bucket_mb:25",
            "ddp-x=",
            "before=source:../old/src,step_on:root",
            "fsdp,lampdist-fsdp",
            "fsdp-root=blocks:false,reshard_after_forward:false",
        ]
    )
    names = [config.name for config in configs]
    assert names == [
        *("single", "ddp", "lampdist-every", "lampdist-ar", "ddp-x", "before"),
        *("fsdp", "lampdist-fsdp", "fsdp-root"),
    ]
    assert configs[2].kind == "lampdist"
    assert configs[2].kwargs == {"step_on": "every_rank"}
    variant = configs[3]
    assert variant.kind == "lampdist"
    assert variant.kwargs == {"step_on": "every_rank", "max_grad_norm": 1.5, "bucket_mb": 25}
    assert variant.rank_kwargs(0) == variant.rank_kwargs(1) == variant.kwargs  # StepOptions
    assert configs[4].kind == "ddp"
    assert configs[4].kwargs == {}
    other = configs[5]  # another source tree: the launcher's key, not the entry point's
    assert other.source == (Path.cwd() / "../old/src").resolve()
    assert other.rank_kwargs(0) == other.rank_kwargs(1) == {"step_on": "root"}
    assert configs[6].kind == "fsdp"
    assert configs[7].kind == "lampdist"
    assert configs[7].kwargs == {"step_on": "fsdp", "fsdp_blocks": True}
    assert configs[8].kind == "fsdp"  # a variant named fsdp...: fully_shard's keywords
    assert configs[8].kwargs == {"blocks": False, "reshard_after_forward": False}
    assert throughput.parse_value("true") is True
    assert throughput.parse_value("none") is None


@pytest.mark.parametrize(
    "items", [["nope"], ["ddp=bucket_cap_mb:1"], ["x=novalue"], ["single", "single"], []]
)
def test_configs_reject_bad_items(throughput: ModuleType, items: list[str]) -> None:
    with pytest.raises(ValueError, match=r"configuration|variant|distinct"):
        throughput.parse_configs(items)


RESULTS = BENCHMARKS / "results"


@pytest.fixture
def plot(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("plot_throughput")


def test_the_plot_draws_one_bar_per_multi_rank_configuration(
    plot: ModuleType, tmp_path: Path
) -> None:
    from xml.etree import ElementTree

    reports = [
        json.loads((RESULTS / name).read_text())
        for name in ("2026-11-29-h200x2-gpt.json", "2026-11-29-h200x2-mlp.json")
    ]
    output = tmp_path / "chart.svg"
    plot.main(
        [*(str(RESULTS / f"2026-11-29-h200x2-{m}.json") for m in ("gpt", "mlp")), "-o", str(output)]
    )
    svg = ElementTree.fromstring(output.read_text())
    bars = [e for e in svg.iter("{http://www.w3.org/2000/svg}rect") if e.get("height") == "22"]
    expected = sum(
        1
        for report in reports
        for entry in report["configs"].values()
        if entry["scaling_efficiency"]
    )
    assert len(bars) == expected == 8
    ddp = reports[0]["configs"]["ddp"]["scaling_efficiency"]
    assert f"{100 * ddp:.1f}%" in output.read_text()


def test_the_plot_needs_the_single_device_loop(plot: ModuleType) -> None:
    report = json.loads((RESULTS / "2026-11-29-h200x2-gpt.json").read_text())
    for entry in report["configs"].values():
        entry["scaling_efficiency"] = None
    with pytest.raises(ValueError, match="'single' configuration"):
        plot.render([report])


def test_the_collectives_benchmark_compares_clique_and_raw_on_cpu(tmp_path: Path) -> None:
    report_path = tmp_path / "collectives.json"
    command = [
        sys.executable,
        str(BENCHMARKS / "collectives.py"),
        "--mode", "cpu", "--size-mib", "1", "--iters", "2", "--warmup", "1", "--repeats", "1",
        "--json", str(report_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["backend"] == "gloo"
    assert set(report["results"]) == {"all_reduce", "reduce", "broadcast"}
    for op, row in report["results"].items():
        for implementation in ("raw", "clique"):
            assert row[implementation]["busbw_gbps"] > 0, (op, implementation)
            assert len(row[implementation]["time_ms_runs"]) == 1
        assert row["ratio"] > 0
    assert "ratio" in result.stdout


def test_the_ratio_to_ddp_is_the_ratio_of_the_medians(throughput: ModuleType) -> None:
    """``vs_ddp`` compares the medians; the per-repeat ratios' median is labelled apart (on
    these runs they differ: 1.25 against 0.83)."""
    Config, RankResult = throughput.Config, throughput.RankResult

    def runs(*samples_per_s: float) -> list[list[Any]]:
        return [
            [RankResult(rank=0, seconds=1.0, timed_steps=1, samples=int(s), peak_memory_bytes=1)]
            for s in samples_per_s
        ]

    configs = [Config(name="ddp", kind="ddp"), Config(name="lampdist", kind="lampdist")]
    summary = throughput.summarize(
        configs, {"ddp": runs(100, 200, 300), "lampdist": runs(300, 100, 250)}
    )
    assert summary["lampdist"]["vs_ddp"] == pytest.approx(250 / 200)
    assert summary["lampdist"]["vs_ddp_paired"] == pytest.approx(250 / 300)  # of 3, 1/2, 5/6
    assert summary["ddp"]["vs_ddp"] is None


def test_a_rank_alone_in_one_process_is_compared_with_the_plain_loop_and_another_tree(
    tmp_path: Path,
) -> None:
    """``rank_alone.py``: the plain loop, this lampdist and another source tree (here the same
    one under another name), each timed once, with the ratio to the plain loop."""
    source = Path(__file__).resolve().parent.parent / "src"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "rank_alone.py"),
            *("--steps", "4", "--warmup", "2", "--repeats", "1"),
            *("--tree", f"again={source}", "--json", str(tmp_path / "alone.json")),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    configs = json.loads((tmp_path / "alone.json").read_text())["configs"]
    assert list(configs) == ["plain", "lampdist", "again"]
    assert configs["plain"]["of_plain"] == 1.0
    assert all(config["samples_per_s"] > 0 for config in configs.values())


CHECKPOINT_WRITE = BENCHMARKS / "checkpoint_write.py"


def run_checkpoint_write(*args: str, json_path: Path) -> dict[str, Any]:
    command = [sys.executable, str(CHECKPOINT_WRITE), *args, "--json", str(json_path)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(json_path.read_text())
    assert json.loads(result.stdout.splitlines()[-1]) == report
    return report


def test_the_checkpoint_write_benchmark_times_every_way_to_write(tmp_path: Path) -> None:
    """torch.save (with and without fsync), to_directory, dcp.save and the asynchronous
    to_directory (blocked and committed), each read back where the benchmark writes it."""
    report = run_checkpoint_write(
        *("--size-mb", "4", "--tensors", "2", "--repeats", "2", "--dir", str(tmp_path)),
        json_path=tmp_path / "write.json",
    )
    methods = [row["method"] for row in report["results"]]
    assert methods == [
        *("torch.save", "torch.save + fsync", "to_directory", "dcp.save"),
        "to_directory async",
    ]
    assert all(len(row["all_s"]) == 2 for row in report["results"])
    assert len(report["results"][-1]["all_blocked_s"]) == 2
    for key in (
        *("torch_save_seconds", "torch_save_fsync_seconds", "sync_seconds"),
        *("dcp_save_seconds", "async_blocked_seconds", "async_total_seconds"),
        *("sync_vs_torch_save", "async_blocked_vs_sync", "async_blocked_fraction_of_sync"),
    ):
        assert report[key] > 0, key
    assert report["sync_vs_torch_save"] == pytest.approx(  # of medians rounded to 0.1 ms
        report["torch_save_seconds"] / report["sync_seconds"], rel=0.05
    )
    assert report["device"] == "cpu"
    assert "s3_put_seconds" not in report
    assert list(tmp_path.iterdir()) == [tmp_path / "write.json"]  # the scratch is removed


def test_the_checkpoint_write_benchmark_compares_to_url_with_obstore(tmp_path: Path) -> None:
    """``--s3``: moto's server on a free port, a plain put and get against to_url and
    load_latest of the URL (which the benchmark checks loads back the last epoch)."""
    for module in ("moto.server", "obstore", "boto3"):
        pytest.importorskip(module)
    report = run_checkpoint_write(
        *("--size-mb", "4", "--tensors", "2", "--repeats", "1", "--s3", "--dir", str(tmp_path)),
        json_path=tmp_path / "s3.json",
    )
    assert report["s3_bytes"] == 4 * 2**20  # --s3-size-mb defaults to --size-mb below 256
    for key in (
        *("s3_put_seconds", "to_url_seconds", "s3_get_load_seconds"),
        *("load_latest_url_seconds", "to_url_vs_put", "load_vs_get_load"),
    ):
        assert report[key] > 0, key
    assert [row["method"] for row in report["s3_results"]] == [
        *("obstore.put", "to_url", "obstore.get + torch.load", "load_latest url")
    ]


def test_the_checkpoint_write_benchmark_trains_with_each_kind_of_checkpoint(
    tmp_path: Path,
) -> None:
    """``--train``: one rank trains three times (no checkpoint, synchronous, asynchronous);
    every checkpoint between two epochs gets its gap and its steps after it."""
    report = run_checkpoint_write(
        *("--train", "mlp", "--mlp-width", "64", "--mlp-depth", "2", "--batch-size", "8"),
        *("--epochs", "3", "--steps", "6", "--after", "2", "--dir", str(tmp_path)),
        json_path=tmp_path / "train.json",
    )
    assert report["mode"] == "train"
    assert list(report["ways"]) == ["none", "sync", "async"]
    assert report["state_bytes"] == 3 * 4 * (2 * 64 * 64 + 2 * 64)  # weights, Adam's 2 moments
    for way, row in report["ways"].items():
        assert row["median_step_seconds"] > 0, way
        assert len(row["epoch_gap_seconds"]) == 2, way
        assert len(row["blocked_per_checkpoint_all_seconds"]) == 2, way
        assert [len(after) for after in row["steps_after_checkpoint_vs_median_all"]] == [2, 2]
        assert row["steps_after_checkpoint_vs_median"]["max"] > 0, way
    assert report["ways"]["none"]["blocked_per_checkpoint_all_seconds"] == [0.0, 0.0]
    assert "target_async_blocked_met" in report
    assert list(tmp_path.iterdir()) == [tmp_path / "train.json"]
