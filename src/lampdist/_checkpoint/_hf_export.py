"""A checkpoint's model as a Hugging Face model directory (``save_pretrained``'s), for a module
that is a transformers ``PreTrainedModel``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import CheckpointError, ConfigError

__all__ = ["hf_model", "write_hf"]

_COMPILED_PREFIX = "_orig_mod."


def hf_model(model: Any) -> Any:
    """The ``PreTrainedModel`` to load the weights into: ``model`` itself, or one built by
    ``AutoModelForCausalLM.from_config`` from a ``PretrainedConfig``, a directory holding a
    ``config.json`` or such a JSON file.

    Raises ConfigError for anything else, or without transformers.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            'exporting a Hugging Face model needs transformers: pip install "lampdist[hf]"',
            phase="configure",
        ) from exc
    if isinstance(model, transformers.PreTrainedModel):
        return model
    config = model
    if isinstance(model, str | os.PathLike):
        path = Path(model)
        if not (path.is_file() or (path / "config.json").is_file()):
            raise ConfigError(
                f"hf={str(model)!r} is neither a config.json nor a directory holding one: pass "
                "the model's config (the directory save_pretrained wrote, or its config.json)",
                phase="configure",
            )
        config = transformers.AutoConfig.from_pretrained(path)
    if not isinstance(config, transformers.PretrainedConfig):
        raise ConfigError(
            f"model={type(model).__name__}: pass a transformers PreTrainedModel, its "
            "PretrainedConfig, or the path of its config directory or config.json",
            phase="configure",
        )
    return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # transformers' own


def write_hf(model: Any, state: Mapping[str, Any], out: Path, *, safe_serialization: bool) -> None:
    """Load ``state`` (the checkpoint's model state dict) into ``model`` and write it to the
    directory ``out`` with ``save_pretrained``; ``out`` appears complete or not at all.

    Raises CheckpointError when the state is not this model's (naming the keys that differ).
    """
    keys = list(state)
    if keys and all(key.startswith(_COMPILED_PREFIX) for key in keys):
        state = {key[len(_COMPILED_PREFIX) :]: value for key, value in state.items()}
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint's model is not a {type(model).__name__} of this config: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}; pass the config the run's "
            "model was built from",
            phase="resume",
        )
    model.load_state_dict(dict(state))
    if out.exists():
        raise ConfigError(
            f"{out} exists: pass a new directory for the Hugging Face model", phase="configure"
        )
    scratch = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        model.save_pretrained(scratch, safe_serialization=safe_serialization)
        os.replace(scratch, out)
    except OSError as exc:
        raise CheckpointError(f"cannot write {out} ({exc})", phase="checkpoint") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
