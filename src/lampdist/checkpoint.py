"""Atomic, complete, resumable checkpoints.

:func:`to_directory` builds the ``checkpoint_state`` effect the training entry points await
after every epoch; :func:`load_latest` reads the newest intact checkpoint back into the
:class:`Resumed` value they take as ``resume=`` (``None``, no checkpoint yet, starts a new
run)::

    resumed = checkpoint.load_latest("runs/a", restore_rng=True)
    await lampdist.drive_distributed_training(
        ...,
        loop=lampdist.LoopOptions(
            max_epochs=100, checkpoint_state=checkpoint.to_directory("runs/a", keep=3)
        ),
        resume=resumed,
    )

:func:`load` reads one chosen checkpoint instead (a path, a URL, or an epoch of a run), and
:func:`export` and :func:`export_hf` write a checkpoint's model for other tools (safetensors,
``torch.save``, a Hugging Face model directory).

A crash or cancellation at any moment leaves the checkpoints committed before it intact and
loadable. Loading never runs code from the files: tensors are raw bytes described by a JSON
header (or, for values that format cannot hold, ``torch.load(weights_only=True)``), and
everything else is JSON.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ._checkpoint import (
    FORMAT_VERSION,
    WRITE_TIMEOUT,
    DirectoryStorage,
    ExportFormat,
    Loaded,
    RngStates,
    UrlStorage,
    check_storage_options,
    is_url,
    read_chosen,
    read_latest,
    read_latest_from_store,
    read_location,
)
from ._effects import CheckpointState
from ._errors import CheckpointError, ConfigError
from ._state import TrainingState
from ._words import counted

__all__ = [
    "FORMAT_VERSION",
    "Resumed",
    "consolidate",
    "export",
    "export_hf",
    "load",
    "load_latest",
    "to_directory",
    "to_url",
]


@attrs.frozen(kw_only=True, repr=False)
class Resumed:
    """Where a checkpointed run left off: what :func:`load_latest` returns and every training
    entry point takes as ``resume=``.

    ``training_state`` holds the loop state (its ``epoch`` is the next one to run), the model,
    optimizer and best-model state dicts. ``schedule_state`` is the learning-rate schedule's
    state as stored, in JSON form: the resumed run rebuilds it against its own schedule
    (:func:`lampdist.schedules.state_from_json`), so any schedule whose state is plain JSON or
    made of attrs or dataclass values resumes. ``rng_states`` (only with
    ``load_latest(restore_rng=True)``) are restored on the root just before training goes on.
    """

    training_state: TrainingState
    schedule_state: Any = None
    rng_states: RngStates | None = attrs.field(default=None, repr=False)
    path: Path | str | None = None
    """The checkpoint directory it was read from (its URL, from an object store)."""

    @property
    def epoch(self) -> int:
        """The next epoch to run."""
        return self.training_state.loop_state.epoch

    def __repr__(self) -> str:
        # What it holds and how big, not the values: the state dicts and every rank's RNG
        # states would fill the screen.
        state = self.training_state
        parts = [
            f"path={str(self.path)!r}" if self.path is not None else "path=None",
            f"epoch={self.epoch}",
        ]
        if state.shards is not None:
            parts.append(f"shards=from {counted(state.shards.nranks, 'rank')}")
        else:
            parts.append(f"model={_tensors(state.model_state)}")
            parts.append(f"optimizer={_tensors(state.optimizer_state)}")
        if state.best_model_state is not None:
            parts.append(f"best_model={_tensors(state.best_model_state)}")
        if state.rank_states is not None:
            parts.append(f"rank_states=for {counted(len(state.rank_states), 'rank')}")
        parts.append(f"rng_states={'yes' if self.rng_states is not None else None}")
        schedule = repr(self.schedule_state)
        if len(schedule) > 60:
            schedule = f"{schedule[:57]}..."
        parts.append(f"schedule_state={schedule}")
        return f"Resumed({', '.join(parts)})"


def _tensors(state: Any) -> str:
    """``'2 tensors (1.2 MB)'``: the tensors in a (nested) state dict, and their bytes."""
    import torch

    count, size = 0, 0
    pending = [state]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            count += 1
            size += value.numel() * value.element_size()
        elif isinstance(value, Mapping):
            pending.extend(value.values())
        elif isinstance(value, list | tuple):
            pending.extend(value)
    return f"{counted(count, 'tensor')} ({_bytes(size)})"


def _bytes(size: int) -> str:
    """``size`` bytes for people: ``'36 B'``, ``'1.2 MB'``."""
    if size < 1000:
        return f"{size} B"
    if size < 1e6:
        return f"{size / 1e3:.1f} kB"
    if size < 1e9:
        return f"{size / 1e6:.1f} MB"
    return f"{size / 1e9:.1f} GB"


def to_directory(
    path: str | os.PathLike[str],
    *,
    keep: int = 3,
    asynchronous: bool = False,
    timeout: float = WRITE_TIMEOUT,
) -> CheckpointState:
    """A ``checkpoint_state`` effect that writes one atomic checkpoint into ``path`` per call.

    Each call writes the loop state (learning curve included), the schedule state, the
    model, optimizer and best-model state dicts, the global RNG states (torch CPU and CUDA,
    python ``random``, numpy) and the format version into a new ``epoch-000012`` directory,
    on a worker thread, whose pool of threads checksums and writes the tensors' bytes block
    by block straight from their memory. The directory appears complete or not at all:
    files go into a scratch directory; every file, that directory and (after the rename
    into place) the parent are fsynced. Afterwards only the newest
    ``keep`` checkpoints are kept. The state dicts must not change until the call returns
    (the training loop awaits it before the next epoch). Cancelling the call before the
    commit removes the partial write.

    With ``asynchronous=True`` the training entry points copy the state into host memory
    (one buffer, pinned when the model is on a GPU, reused by every checkpoint), go on
    training, and write on a thread of their own: training waits only for the copies. At
    most one write is in flight: a checkpoint due while the previous one is still writing
    waits for it, up to ``timeout`` seconds (past it, that write is aborted and the run ends
    with a CheckpointError of phase ``checkpoint``). A write that fails ends the run with a
    CheckpointError of phase ``checkpoint`` at the next epoch boundary at the latest. The
    end of the run, a graceful stop and a failure wait for the write in flight (so its
    checkpoint is committed); a cancellation aborts it and removes its partial output.
    Awaited directly (outside a training entry point), the effect writes before returning.

    Give each run its own directory: the effect owns it. Before training, the root refuses
    (CheckpointError) a new run into a directory that holds checkpoints, and a resumed run
    into one whose newest checkpoint is newer than the first it would write; the effect
    itself refuses to write an epoch older than the newest checkpoint there, which would
    otherwise shadow it.
    (The training entry points check before each checkpoint that the schedule state comes
    back from its JSON form as it was, so that a resumed run gets the same state.)

    Raises ConfigError for ``keep < 1`` or a ``timeout`` that is not a positive number and,
    when awaited, CheckpointError when the state cannot be checkpointed (a value that
    neither the tensor file nor ``torch.load(weights_only=True)`` could load back, a
    schedule state not made of numbers) or the disk write fails.
    """
    check_storage_options(keep, asynchronous, timeout)
    return DirectoryStorage(
        directory=Path(path), keep=keep, asynchronous=asynchronous, timeout=float(timeout)
    )


def to_url(
    url: str,
    *,
    keep: int = 3,
    asynchronous: bool = False,
    timeout: float = WRITE_TIMEOUT,
    options: Mapping[str, str] | None = None,
) -> CheckpointState:
    """A ``checkpoint_state`` effect that writes one checkpoint per call into an object
    store: ``s3://bucket/run``, ``gs://bucket/run``, ``az://container/run`` (needs
    ``pip install "lampdist[object-store]"``).

    The checkpoint is the same files as :func:`to_directory` writes, under
    ``url/epoch-000012/``, uploaded in parallel parts with retries; ``manifest.json`` is
    uploaded last and is the commit: a checkpoint without it does not exist for
    :func:`load_latest`, and the next write removes it. Old checkpoints beyond ``keep`` are
    deleted only after a newer one is committed (their manifest first). ``asynchronous`` and
    ``timeout`` are those of :func:`to_directory`.

    Credentials come from the object store library's usual sources (environment variables
    such as ``AWS_ACCESS_KEY_ID``, configuration files, instance metadata); ``options`` are
    that library's (obstore's) store configuration, e.g. ``{"endpoint": ..., "region":
    ...}``. Neither is written into a checkpoint or a log.

    Raises ConfigError for a ``url`` that names no object store or for bad values, and,
    when awaited, CheckpointError when an upload fails after its retries (naming the
    object): the checkpoints committed before it are intact.
    """
    if not is_url(url):
        raise ConfigError(
            f"{url!r} names no object store (s3://, gs://, az://...): for a directory use "
            "checkpoint.to_directory",
            phase="configure",
        )
    check_storage_options(keep, asynchronous, timeout)
    return UrlStorage(
        url=str(url).rstrip("/"),
        keep=keep,
        asynchronous=asynchronous,
        timeout=float(timeout),
        options=None if options is None else dict(options),
    )


def load_latest(
    path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    restore_rng: bool = False,
    options: Mapping[str, str] | None = None,
) -> Resumed | None:
    """The newest intact checkpoint in ``path`` (a directory, or the URL of an object
    store's prefix that :func:`to_url` writes to, read with ``options``) as a
    :class:`Resumed`, or ``None``.

    Pass the result as ``resume=`` to any training entry point; ``None`` means there is no
    checkpoint yet (the directory is missing, empty, or holds only scratch of an interrupted
    first write), and ``resume=None`` starts a new run. ``map_location`` places tensors as
    ``torch.load``'s does (a device, a string, a dict of locations, or a function of a storage
    and its location). With ``restore_rng=True`` the global RNG states saved with the
    checkpoint (torch CPU and CUDA, python ``random``, numpy) come with it, and the run restores
    them on the root just before training goes on, so that it draws the same random numbers
    as an uninterrupted one.

    A damaged newest checkpoint (truncated, a flipped byte, a missing file, a malformed
    tensor file: every file is checked against the block checksums in its manifest) is
    skipped with a WARNING log and the one before it is used. Checkpoints of the previous
    format (lampdist's format 1) load as well. This call blocks; from async code run it in a
    worker thread (``await anyio.to_thread.run_sync(functools.partial(load_latest, path,
    ...))``).

    Raises CheckpointVersionError when a checkpoint was written in a newer format (upgrade
    lampdist), and CheckpointError when there are checkpoints but none is intact, or when a
    file cannot be loaded (e.g. a bad ``map_location``, a tensor file of the other byte order).
    """
    if is_url(path):
        assert isinstance(path, str)
        loaded = read_latest_from_store(path, map_location=map_location, options=options)
    else:
        loaded = read_latest(Path(path), map_location=map_location)
    if loaded is None:
        return None
    return _resumed(loaded, restore_rng=restore_rng, options=options)


def load(
    path: str | os.PathLike[str],
    *,
    epoch: int | None = None,
    map_location: Any = None,
    restore_rng: bool = False,
    options: Mapping[str, str] | None = None,
) -> Resumed:
    """One chosen checkpoint as a :class:`Resumed`, to pass as ``resume=``: ``path`` is that
    checkpoint's directory (``runs/a/epoch-000003``, or a copy of it or a symlink to it, under
    any name) or URL (``s3://bucket/run/epoch-000003``, read with ``options``); with
    ``epoch``, ``path`` is a run's directory or URL and the checkpoint of that epoch there is
    read. ``map_location`` and ``restore_rng`` are :func:`load_latest`'s.

    Unlike :func:`load_latest`, nothing is skipped: a damaged checkpoint is an error. This
    call blocks (``lampdist.train(resume=path)`` calls it on a worker thread).

    Raises ConfigError when ``path`` is no checkpoint (a run's directory: pass ``epoch``, or
    use :func:`load_latest`) or holds no checkpoint of ``epoch``; CheckpointError when the
    checkpoint is damaged or cannot be read, and CheckpointVersionError for a newer format.
    """
    loaded = read_chosen(path, epoch=epoch, map_location=map_location, options=options)
    return _resumed(loaded, restore_rng=restore_rng, options=options)


def _resumed(loaded: Loaded, *, restore_rng: bool, options: Mapping[str, str] | None) -> Resumed:
    shards = loaded.training_state.shards
    if shards is not None and options is not None:  # the ranks download the shards with them
        shards = attrs.evolve(shards, options=dict(options))
        loaded = attrs.evolve(
            loaded, training_state=attrs.evolve(loaded.training_state, shards=shards)
        )
    stored = loaded.lr_state_json
    return Resumed(
        training_state=loaded.training_state,
        schedule_state=stored["value"]
        if isinstance(stored, dict) and "value" in stored
        else stored,
        rng_states=loaded.rng if restore_rng else None,
        path=loaded.path,
    )


def consolidate(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    epoch: int | None = None,
    options: Mapping[str, str] | None = None,
) -> Path | str:
    """Write the model of a checkpoint to ``out`` as one plain ``state_dict``
    (``torch.load(out, weights_only=True)`` reads it back; load it into the model for
    inference), whether every rank wrote its own shards (``step_on="fsdp"``) or the root the
    whole model. The checkpoint is ``path`` itself when it is one checkpoint's directory or
    URL, the one of ``epoch`` with ``epoch``, else the newest intact one in ``path`` (a
    directory, or an object store URL read with ``options``, as by :func:`load_latest`).
    ``out`` appears complete or not at all. Returns the checkpoint it was read from. This
    call blocks and holds the whole model in host memory (:func:`export` holds one tensor).

    Raises CheckpointError when ``path`` holds no checkpoint or none is intact, and the
    errors of :func:`load` and :func:`load_latest`.
    """
    import torch

    from ._checkpoint import local_shards, read_whole

    loaded = _read_model(path, epoch, options)
    state = loaded.training_state
    model = dict(state.model_state)
    if state.shards is not None:
        with local_shards(state.shards.path, state.shards.options) as shards:
            model, _ = read_whole(shards)
    target = Path(out)
    scratch = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        torch.save(model, scratch)
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)
    return loaded.path


def export(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: ExportFormat = "safetensors",  # the CLI's --format
    best: bool = False,
    epoch: int | None = None,
    options: Mapping[str, str] | None = None,
) -> Path | str:
    """Write a checkpoint's model weights to the file ``out``: ``format="safetensors"``
    (``safetensors.torch.load_file(out)`` reads it) or ``"torch"`` (a plain state dict,
    ``torch.load(out, weights_only=True)``), equal to the model's ``state_dict``; the best
    model's with ``best=True``. The checkpoint is chosen as by :func:`consolidate` (``path``
    a checkpoint, a run's with ``epoch``, or its newest intact one).

    A sharded checkpoint (``step_on="fsdp"``) is consolidated one tensor at a time: each is
    read whole from every rank's shards and written out before the next is read, so memory
    holds one tensor of the model, not the model. ``out`` appears complete or not at all.
    Returns the checkpoint it was read from. This call blocks.

    Raises ConfigError for an unknown ``format``, ``best=True`` without a best model in the
    checkpoint (an fsdp run keeps none), or a state dict that safetensors cannot hold;
    CheckpointError when there is no checkpoint, it is damaged or the write fails; and the
    errors of :func:`load`.
    """
    from ._checkpoint import FORMATS, local_shards, sharded_weights, whole_weights, write_weights

    if format not in FORMATS:
        raise ConfigError(
            f"format={format!r} is no export format: pass one of {', '.join(FORMATS)}",
            phase="configure",
        )
    loaded = _read_model(path, epoch, options)
    state = loaded.training_state
    if state.shards is not None and not best:
        with local_shards(state.shards.path, state.shards.options) as shards:
            write_weights(sharded_weights(shards), Path(out), format)
    else:
        write_weights(whole_weights(_model_state(loaded, best=best)), Path(out), format)
    return loaded.path


def export_hf(
    path: str | os.PathLike[str],
    model: Any,
    out: str | os.PathLike[str],
    *,
    format: ExportFormat = "safetensors",
    best: bool = False,
    epoch: int | None = None,
    options: Mapping[str, str] | None = None,
) -> Path | str:
    """Write a checkpoint's model (a transformers ``PreTrainedModel``) as a new Hugging Face
    model directory ``out``, which ``transformers.AutoModelForCausalLM.from_pretrained(out)``
    (or the model's own class) loads. ``model`` is the model to load the weights into and
    save (its weights are replaced), or its config: a ``PretrainedConfig``, a directory
    holding its ``config.json``, or that file (the model is then built by
    ``AutoModelForCausalLM.from_config``). ``format`` is that of the weights' files; the
    checkpoint is chosen as by :func:`export`. The whole model is held in memory. Returns the
    checkpoint it was read from. This call blocks.

    Raises ConfigError for a ``model`` that is none of those, an existing ``out``, or without
    transformers (``pip install "lampdist[hf]"``); CheckpointError when the checkpoint's model
    is not this model; and the errors of :func:`export`.
    """
    from ._checkpoint import FORMATS, hf_model, local_shards, read_whole, write_hf

    if format not in FORMATS:
        raise ConfigError(
            f"format={format!r} is no export format: pass one of {', '.join(FORMATS)}",
            phase="configure",
        )
    target = hf_model(model)
    loaded = _read_model(path, epoch, options)
    state = loaded.training_state
    weights: Mapping[str, Any]
    if state.shards is not None and not best:
        with local_shards(state.shards.path, state.shards.options) as shards:
            weights, _ = read_whole(shards)
    else:
        weights = _model_state(loaded, best=best)
    write_hf(target, weights, Path(out), safe_serialization=format == "safetensors")
    return loaded.path


def _read_model(
    path: str | os.PathLike[str], epoch: int | None, options: Mapping[str, str] | None
) -> Loaded:
    """The checkpoint that :func:`consolidate` and :func:`export` read, its tensors on the
    CPU; raises CheckpointError when there is none."""
    loaded = read_location(path, epoch=epoch, map_location="cpu", options=options)
    if loaded is None:
        raise CheckpointError(f"{path} holds no checkpoint", phase="resume")
    return loaded


def _model_state(loaded: Loaded, *, best: bool) -> Mapping[str, Any]:
    state = loaded.training_state
    if not best:
        return state.model_state
    if state.best_model_state is None:
        raise ConfigError(
            f"best=True: checkpoint {loaded.path} holds no best model (a run keeps one with "
            "LoopOptions(return_min_validation_loss_model=...), and not under "
            "step_on='fsdp'): export the last model instead",
            phase="configure",
        )
    return state.best_model_state
