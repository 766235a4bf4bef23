"""``lampdist.from_safetensors``: which files hold the weights, whether they fit a module (the
errors name every difference), and loading them whole into a module that one process holds.
The fsdp runs that read their shards are in tests/roles/test_fsdp_import.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lampdist

safetensors_torch = pytest.importorskip("safetensors.torch")


def mlp(seed: int, width: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


def saved(tmp_path: Path, module: torch.nn.Module) -> Path:
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(module.state_dict(), path)
    return path


def assert_same(got: torch.nn.Module, want: torch.nn.Module) -> None:
    theirs = want.state_dict()
    assert sorted(got.state_dict()) == sorted(theirs)
    for name, value in got.state_dict().items():
        assert torch.equal(value, theirs[name]), name


def test_a_file_loads_into_a_module(tmp_path: Path) -> None:
    source, target = mlp(1), mlp(2)
    lampdist.from_safetensors(saved(tmp_path, source)).load_into(target)
    assert_same(target, source)


@pytest.mark.parametrize("through", ["index", "directory"])
def test_a_sharded_set_loads_through_its_index_or_its_directory(
    tmp_path: Path, through: str
) -> None:
    source, target = mlp(1), mlp(2)
    state = source.state_dict()
    weight_map = {}
    for index, names in enumerate((["0.weight", "0.bias"], ["2.weight", "2.bias"])):
        file = f"part-{index}.safetensors"
        safetensors_torch.save_file({n: state[n] for n in names}, tmp_path / file)
        weight_map.update(dict.fromkeys(names, file))
    index_file = tmp_path / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"weight_map": weight_map}))
    weights = lampdist.from_safetensors(index_file if through == "index" else tmp_path)
    assert weights.files() == {n: tmp_path / f for n, f in weight_map.items()}
    weights.load_into(target)
    assert_same(target, source)


def test_a_transformers_directory_loads_with_its_tied_head(tmp_path: Path) -> None:
    """``save_pretrained`` stores GPT2's head once (tied to the token embedding): it loads
    from the embedding, and stays tied."""
    pytest.importorskip("transformers")
    import transformers

    hf: Any = transformers  # untyped
    config = hf.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    torch.manual_seed(1)
    source = hf.GPT2LMHeadModel(config)
    source.save_pretrained(tmp_path)
    torch.manual_seed(2)
    target = hf.GPT2LMHeadModel(config)
    lampdist.from_safetensors(tmp_path).load_into(target)
    assert_same(target, source)
    assert target.lm_head.weight is target.transformer.wte.weight


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    state = mlp(1).state_dict()
    state["0.weight"] = torch.zeros(4, 3)
    del state["2.bias"]
    state["extra"] = torch.zeros(2)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, path)
    target = mlp(2)
    before = {n: t.clone() for n, t in target.state_dict().items()}
    with pytest.raises(lampdist.ConfigError) as raised:
        lampdist.from_safetensors(path).load_into(target)
    message = str(raised.value)
    assert "3 differences" in message
    assert "'0.weight': shape (4, 3) stored, (6, 3) in the model" in message
    assert "'2.bias': in the model, not stored" in message
    assert "'extra': stored, not in the model" in message
    assert "strict=False" in message
    assert all(torch.equal(t, before[n]) for n, t in target.state_dict().items())  # untouched


def test_strict_false_keeps_the_missing_and_ignores_the_unexpected(tmp_path: Path) -> None:
    source, target = mlp(1), mlp(2)
    state = source.state_dict()
    kept = target.state_dict()["2.bias"].clone()
    del state["2.bias"]
    state["extra"] = torch.zeros(2)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, path)
    lampdist.from_safetensors(path, strict=False).load_into(target)
    assert torch.equal(target.state_dict()["2.bias"], kept)
    assert torch.equal(target.state_dict()["0.weight"], source.state_dict()["0.weight"])
    state["0.weight"] = torch.zeros(4, 3)  # shapes must match even so
    safetensors_torch.save_file(state, path)
    with pytest.raises(lampdist.ConfigError, match=r"'0.weight': shape \(4, 3\) stored"):
        lampdist.from_safetensors(path, strict=False).load_into(target)


def test_bad_paths_and_options_fail_naming_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(lampdist.ConfigError, match="does not exist"):
        lampdist.from_safetensors(tmp_path / "none.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        lampdist.ConfigError, match=r"holds neither model\.safetensors\.index\.json"
    ):
        lampdist.from_safetensors(tmp_path).files()
    index = tmp_path / "bad.index.json"
    index.write_text("{}")
    with pytest.raises(lampdist.ConfigError, match="is not a safetensors index"):
        lampdist.from_safetensors(index).files()
    with pytest.raises(lampdist.ConfigError, match="initial_weights must be"):
        lampdist.FsdpPolicy(initial_weights=str(index))  # type: ignore[arg-type]
    weights = lampdist.from_safetensors(saved(tmp_path, mlp(1)))
    with pytest.raises(lampdist.ConfigError, match="applies to step_on='fsdp', not 'root'"):
        lampdist.StepOptions(fsdp=lampdist.FsdpPolicy(initial_weights=weights))


def test_the_policy_names_the_weights_the_same_in_every_process(tmp_path: Path) -> None:
    """The agreement check compares the policy's text: the path and ``strict``, no address."""
    path = saved(tmp_path, mlp(1))
    policy = lampdist.FsdpPolicy(initial_weights=lampdist.from_safetensors(path, strict=False))
    code = (
        "import lampdist, sys; print(repr(lampdist.FsdpPolicy(initial_weights="
        "lampdist.from_safetensors(sys.argv[1], strict=False))))"
    )
    printed = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert printed == repr(policy)
    assert f"initial_weights=from_safetensors({str(path)!r}, strict=False)" in printed


def test_lampdist_imports_safetensors_only_to_read_weights() -> None:
    code = (
        "import sys, lampdist; lampdist.from_safetensors; lampdist.FsdpPolicy; "
        "print('safetensors' in sys.modules)"
    )
    printed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert printed == "False"
