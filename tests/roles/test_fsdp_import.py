"""``FsdpPolicy(initial_weights=from_safetensors(...))``: an fsdp run in processes of their own
over Gloo starts from stored weights (one file, a sharded set with its index, a transformers
directory), each rank reading only the slices of its own shards, and trains exactly like a run
that starts from the same weights in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ._launch import launch_ranks
from .reference import make_model
from .test_fsdp import assembled

pytestmark = pytest.mark.skipif(
    not hasattr(torch.distributed, "init_process_group"), reason="torch without distributed"
)
safetensors_torch = pytest.importorskip("safetensors.torch")


def launch(out: Path, *extra: str, nranks: int = 2) -> list[tuple[int, str]]:
    """Every rank of :mod:`.import_rank` to its end: each one's exit code and stderr."""
    out.mkdir(exist_ok=True)
    return launch_ranks("import_rank", out, nranks, *extra)


def run(out: Path, *extra: str) -> Path:
    for rank, (code, error) in enumerate(launch(out, *extra)):
        assert code == 0, f"rank {rank}: {error[-3000:]}"
    return out


def assert_same_run(got: Path, want: Path) -> None:
    """Bitwise the same final weights (every rank's shards) and learning curve."""
    mine, theirs = assembled(got, 2), assembled(want, 2)
    assert sorted(mine) == sorted(theirs)
    for name, value in theirs.items():
        assert torch.equal(mine[name], value), name
    assert json.loads((got / "curve.json").read_text()) == json.loads(
        (want / "curve.json").read_text()
    )


def write_sharded(state: dict[str, torch.Tensor], directory: Path) -> Path:
    """``state`` as Hugging Face writes a sharded set: two files and their index."""
    directory.mkdir()
    names = sorted(state)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for index, part in enumerate(parts, start=1):
        file = f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        safetensors_torch.save_file({n: state[n].contiguous() for n in part}, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    index_file = directory / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index_file


def test_an_fsdp_run_from_safetensors_equals_one_from_the_same_weights_in_memory(
    tmp_path: Path,
) -> None:
    """A model built on the meta device on every rank starts from a safetensors file, or from
    a sharded set through its index: the run equals, bitwise, one whose root holds the same
    weights in memory (broadcast, then sharded). Each rank got from safetensors exactly the
    bytes of its own shards: every stored tensor's slice this rank keeps, never the whole."""
    state = make_model(seed=5).state_dict()
    single = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, single)
    index = write_sharded(state, tmp_path / "sharded")
    memory = run(tmp_path / "memory", "--seed", "5")
    for source, name in ((single, "file"), (index, "index")):
        out = run(tmp_path / name, "--meta", "--weights", str(source), "--count-reads")
        assert_same_run(out, memory)
        reads = [json.loads((out / f"read{rank}.json").read_text()) for rank in range(2)]
        for rank, read in enumerate(reads):
            kept = {n: t.nbytes for n, t in run_parts(out, rank).items() if t.nbytes}
            assert read == kept, (name, rank)  # the bytes of its own shards, no more
        whole = sum(t.nbytes for t in state.values())
        assert sum(sum(read.values()) for read in reads) == whole  # each byte read once


def run_parts(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s local parts (their sizes are those it started from)."""
    parts: dict[str, torch.Tensor] = torch.load(out / f"rank{rank}.pt", weights_only=True)
    return parts


def test_a_transformers_gpt2_starts_from_its_directory(tmp_path: Path) -> None:
    """A tiny GPT2 (its head tied to its token embedding, which ``save_pretrained`` stores
    once) built on the meta device on every rank, each block an fsdp unit, starts from its
    ``save_pretrained`` directory; only its attention's causal mask, a buffer it does not
    store, is initialized. The run equals, bitwise, one whose root holds the module's own
    weights in memory."""
    pytest.importorskip("transformers")
    from .import_rank import gpt2

    directory = tmp_path / "gpt2"
    gpt2(seed=7).save_pretrained(directory)
    assert "lm_head.weight" not in safetensors_torch.load_file(directory / "model.safetensors")
    memory = run(tmp_path / "memory", "--model", "gpt2", "--seed", "7", "--epochs", "1")
    stored = run(
        tmp_path / "stored",
        "--model",
        "gpt2",
        "--meta",
        "--weights",
        str(directory),
        "--epochs",
        "1",
    )
    assert_same_run(stored, memory)


def test_stored_weights_of_another_model_fail_on_every_rank_before_training(
    tmp_path: Path,
) -> None:
    """A file of a narrower model: every rank fails at setup with a ConfigError naming the
    shape mismatches, before any tensor is allocated or any step taken."""
    single = tmp_path / "model.safetensors"
    safetensors_torch.save_file(make_model(seed=5).state_dict(), single)
    ended = launch(tmp_path / "wide", "--meta", "--width", "8", "--weights", str(single))
    assert all(code != 0 for code, _ in ended)
    for rank, (_, error) in enumerate(ended):
        assert f"ConfigError: rank {rank}, phase 'configure'" in error, error[-2000:]
        assert "'0.weight': shape (6, 3) stored, (8, 3) in the model" in error
    assert not (tmp_path / "wide" / "curve.json").exists()
