"""Hand-written mutants of lampdist's central paths: each switches one guarantee off, and the
tests named beside it must fail.

    python tests/mutants.py [--list] [NAME ...]      (nox -s mutants)

Each mutant replaces one exact snippet of one source file in a copy of ``src`` (the checkout
is never touched) and runs its tests against that copy (``PYTHONPATH`` puts it first). A
mutant is *killed* when the tests fail, and *survives* when they pass; a snippet that is no
longer in the source is an error, so that the list keeps up with the code. The exit status is
the number of survivors and errors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
TIMEOUT = 600


@attrs.frozen(kw_only=True)
class Mutant:
    name: str
    guarantee: str
    path: str
    """Relative to ``src/lampdist``."""
    old: str
    new: str
    tests: tuple[str, ...]


EXACTNESS = "tests/roles/test_local_exactness.py"
TORCHRUN = "tests/reliability/test_torchrun.py"
RESUME = "tests/roles/test_local_resume.py"
DRIVER = "tests/loop/test_driver.py"
METRICS = "tests/roles/test_local_metrics.py"
MONITORS = "tests/loop/test_monitors.py"
LOCAL_MONITORS = "tests/roles/test_local_monitors.py"
SHARDED = "tests/roles/test_local_sharded.py"
STEPS = "tests/roles/test_local_steps.py"
CALLABLE_SCHEDULES = "tests/roles/test_callable_schedules.py"
BLAME = "tests/roles/test_local_blame.py"
LOSS_MODEL = "tests/roles/test_loss_model.py"
FSDP = "tests/roles/test_fsdp.py"
TELEMETRY = "tests/epoch/test_telemetry.py"
MIXED_PRECISION = (
    EXACTNESS + "::test_mixed_precision_matches_autocast_and_grad_scaler_in_a_plain_loop"
)
NAMES_RANKS = BLAME + "::test_a_non_finite_loss_names_the_ranks_it_came_from"
RECOVERY = "tests/roles/test_recovery.py"
KILLED = RECOVERY + "::test_a_killed_follower_is_replaced_and_the_run_ends_as_if_nothing_happened"
STALLED = RECOVERY + "::test_a_stalled_follower_is_replaced_and_its_process_told_to_go"
ENDED = RECOVERY + "::test_a_stalled_follower_on_the_roots_machine_is_ended_and_replaced"
FAULTS = "tests/reliability/test_process_faults.py"
REFORMS = RECOVERY + "::test_a_rank_alone_reforms_its_clique_and_goes_back_to_its_snapshot"
ASYNCHRONOUS = "tests/checkpoint/test_asynchronous.py"
MANIFEST_LAST = "tests/checkpoint/test_object_store.py::test_the_manifest_is_uploaded_last"

MUTANTS = [
    Mutant(
        name="gradients-not-averaged",
        guarantee="the gradient is the example-weighted average over every rank",
        path="_epoch/_stepper.py",
        old="divisor = (1.0 if averaged else scale.weight(examples)) * scale.factor",
        new="divisor = 1.0 * scale.factor",
        tests=(EXACTNESS,),
    ),
    Mutant(
        name="batches-weighted-equally",
        guarantee="each batch's loss is weighted by its example count",
        path="_epoch/_designs/_exchanging.py",
        old="weight = self.loss_scale.weight(batch.weight)",
        new="weight = 1",
        tests=(EXACTNESS,),
    ),
    Mutant(
        name="tokens-weighted-by-examples",
        guarantee="mean_over='tokens' weights each batch by its tokens (every weighting)",
        path="_model.py",
        old='    if mean_over == "examples":\n        return examples\n',
        new="    if True:\n        return examples\n",
        tests=(
            LOSS_MODEL
            + "::test_a_token_mean_loss_trains_like_one_process_on_the_concatenated_batches",
        ),
    ),
    Mutant(
        name="step-weighted-by-examples",
        guarantee="an exchanging design weights a batch's loss and gradients by its weight",
        path="_epoch/_designs/_exchanging.py",
        old="            weight = self.loss_scale.weight(batch.weight)",
        new="            weight = self.loss_scale.weight(batch.examples)",
        tests=(
            LOSS_MODEL
            + "::test_a_token_mean_loss_trains_like_one_process_on_the_concatenated_batches",
        ),
    ),
    Mutant(
        name="alone-weighted-by-examples",
        guarantee="a rank alone weights each batch by its share of the step's weight",
        path="_epoch/_designs/_solo.py",
        old="    total = sum(batch.weight for batch in taken)",
        new="    total = sum(batch.examples for batch in taken)",
        tests=(
            LOSS_MODEL
            + "::test_a_token_mean_loss_trains_like_one_process_on_the_concatenated_batches",
        ),
    ),
    Mutant(
        name="validation-weighted-by-examples",
        guarantee="the validation loss weights each batch by its weight (tokens)",
        path="_epoch/_model_code.py",
        old="        return loss.to(torch.float64) * batch.weight",
        new="        return loss.to(torch.float64) * batch.examples",
        tests=(
            LOSS_MODEL
            + "::test_a_token_mean_loss_trains_like_one_process_on_the_concatenated_batches",
        ),
    ),
    Mutant(
        name="fsdp-weighted-by-examples",
        guarantee="fsdp weights a batch's loss and gradients by its weight",
        path="_epoch/_designs/_fsdp.py",
        old="                    sums.add(batches.backward(batch, weight), batch.weight)",
        new="                    sums.add(batches.backward(batch, weight), batch.examples)",
        tests=(LOSS_MODEL + "::test_processes_over_tcp_train_a_token_mean_loss_like_one_process",),
    ),
    Mutant(
        name="events-count-tokens-as-examples",
        guarantee="with mean_over='tokens' the events count examples, not the weight",
        path="_epoch/_watch.py",
        old="        if self.telemetry.by_examples:\n            return weight\n",
        new="        if True:\n            return weight\n",
        tests=(
            LOSS_MODEL
            + "::test_a_token_mean_loss_trains_like_one_process_on_the_concatenated_batches",
        ),
    ),
    Mutant(
        name="no-accumulation",
        guarantee="accumulate_gradient_over_n_batches batches make one step",
        path="_epoch/_kernel.py",
        old="feed=feed, backward=backward, accumulate=accumulate, pad=pad, counts=counts",
        new="feed=feed, backward=backward, accumulate=1, pad=pad, counts=counts",
        tests=(EXACTNESS,),
    ),
    Mutant(
        name="no-clipping",
        guarantee="max_grad_norm clips the averaged gradients by their global norm",
        path="_epoch/_stepper.py",
        old="        max_norm = self.options.max_grad_norm\n        if max_norm is None:\n",
        new="        max_norm = None\n        if max_norm is None:\n",
        tests=(
            "tests/roles/test_local_exactness.py::test_clipping_matches_clip_grad_norm_in_a_plain_loop",
        ),
    ),
    Mutant(
        name="fp16-weighted-by-examples",
        guarantee="with fp16 loss scaling on several ranks a batch's loss is weighted by its "
        "share of the nominal step, so that the scaled gradients are GradScaler's",
        path="_epoch/_stepper.py",
        old="if not self.enabled or self.nominal == 0:",
        new="if True:",
        tests=(MIXED_PRECISION,),
    ),
    Mutant(
        name="fp16-nominal-not-sent",
        guarantee="under step_on='root' the followers take the nominal step from the root",
        path="_epoch/_designs/_root.py",
        old="self.loss_scale.scale, self.loss_scale.nominal = scale, int(nominal)",
        new="self.loss_scale.scale = scale",
        tests=(MIXED_PRECISION,),
    ),
    Mutant(
        name="loss-scale-never-backs-off",
        guarantee="fp16 overflow halves the loss scale (as GradScaler does)",
        path="_epoch/_stepper.py",
        old="self.scale /= 2.0",
        new="self.scale /= 1.0",
        tests=(EXACTNESS,),
    ),
    Mutant(
        name="validation-cadence-inverted",
        guarantee="epoch e is validated when e % validation_frequency == 0",
        path="_loop/_driver.py",
        old="epoch % rules.validation_frequency == 0",
        new="epoch % rules.validation_frequency != 0",
        tests=(DRIVER,),
    ),
    Mutant(
        name="no-smoothing",
        guarantee="the validation loss is smoothed exponentially across epochs",
        path="_loop/_driver.py",
        old="return factor * raw + (1.0 - factor) * previous",
        new="return raw",
        tests=(DRIVER,),
    ),
    Mutant(
        name="best-model-on-ties",
        guarantee="the best model moves only on a strict improvement",
        path="_monitor.py",
        old="return value + min_delta < (best if best is not None else math.inf)",
        new="return value + min_delta <= (best if best is not None else math.inf)",
        tests=(DRIVER,),
    ),
    Mutant(
        name="best-model-outside-its-epochs",
        guarantee="the best model is chosen among return_min_validation_loss_model's epochs",
        path="_loop/_driver.py",
        old="    if point.epoch not in loop.save_epochs:\n        return best_so_far",
        new="    if False:\n        return best_so_far",
        tests=(DRIVER,),
    ),
    Mutant(
        name="plateau-patience-off-by-one",
        guarantee="reduce_on_plateau reduces after `patience` epochs without improvement",
        path="schedules.py",
        old="if epoch - state.last_improvement_epoch >= self.patience:",
        new="if epoch - state.last_improvement_epoch > self.patience:",
        tests=("tests/test_schedules.py",),
    ),
    Mutant(
        name="resume-ignores-the-model",
        guarantee="a resumed run continues from the checkpoint's weights",
        path="_roles/_run_state.py",
        old="    load_model_state(module, model_state, path=resume.path)\n",
        new="",
        tests=(RESUME, "tests/roles/test_resume_from_disk.py"),
    ),
    Mutant(
        name="resume-ignores-the-optimizer",
        guarantee="a resumed run restores the optimizer state",
        path="_roles/_run_state.py",
        old="    load_optimizer_state(stepper, optimizer_state, path=resume.path)\n",
        new="",
        tests=(RESUME,),
    ),
    Mutant(
        name="resume-restarts-at-epoch-0",
        guarantee="a resumed run trains only the epochs left",
        path="_roles/_root.py",
        old="            loop_state = resume.training_state.loop_state\n",
        new="",
        tests=(RESUME, "tests/reliability/test_local_faults.py"),
    ),
    Mutant(
        name="checksums-not-verified",
        guarantee="load_latest skips a damaged checkpoint (every file checked)",
        path="_checkpoint/_read.py",
        old="    _compare(record, len(data), _digests(memoryview(data), checksum), checksum)\n",
        new="    pass\n",
        tests=("tests/checkpoint/test_checkpoint.py",),
    ),
    Mutant(
        name="staged-copy-is-the-state",
        guarantee="an asynchronous checkpoint writes a copy of the state, not the live tensors",
        path="_checkpoint/_staging.py",
        old="            copies[id(tensor)] = target\n",
        new="            copies[id(tensor)] = tensor\n",
        tests=(ASYNCHRONOUS,),
    ),
    Mutant(
        name="checkpoint-due-does-not-wait",
        guarantee="a checkpoint due while one is still writing waits for it (one write in flight)",
        path="_checkpoint/_background.py",
        old='        await self._wait(f"epoch {epoch}\'s checkpoint was due")\n',
        new="",
        tests=(ASYNCHRONOUS,),
    ),
    Mutant(
        name="failed-write-swallowed",
        guarantee="an asynchronous write that fails is reported, never swallowed",
        path="_checkpoint/_background.py",
        old="        failure, self._failure = self._failure, None\n",
        new="        failure, self._failure = None, None\n",
        tests=(ASYNCHRONOUS,),
    ),
    Mutant(
        name="cancellation-leaves-the-write",
        guarantee="a cancelled run aborts the asynchronous write in flight",
        path="_checkpoint/_background.py",
        old="            await writer.abort()\n",
        new="            pass\n",
        tests=(ASYNCHRONOUS,),
    ),
    Mutant(
        name="store-manifest-not-last",
        guarantee="in an object store the manifest is uploaded last, after every abort point",
        path="_checkpoint/_object_store.py",
        old="        check()  # the last point at which a cancellation aborts the write\n",
        new=(
            '        put(store, url, f"{name.name}/{MANIFEST}", [manifest], len(manifest))\n'
            "        check()\n"
        ),
        tests=(MANIFEST_LAST,),
    ),
    Mutant(
        name="shuffle-seed-ignores-the-epoch",
        guarantee="every pass shuffles with a seed of its own",
        path="_source.py",
        old='f"lampdist/{shuffle_seed}/{rank}/{epoch}/{kind}"',
        new='f"lampdist/{shuffle_seed}/{rank}/{kind}"',
        tests=("tests/roles/test_shuffled_data.py",),
    ),
    Mutant(
        name="no-agreement",
        guarantee="ranks with other models or settings are refused before training",
        path="_roles/_agreement.py",
        old="    if not model_ranks and not settings_ranks:\n        return\n",
        new="    return\n",
        tests=("tests/roles/test_local_failures.py",),
    ),
    Mutant(
        name="metrics-not-reduced",
        guarantee="a training pass's metrics are summed over every rank",
        path="_epoch/_peers.py",
        old="        self.clique.start_reduce([summed], root=0).wait_blocking(None)\n",
        new="        pass\n",
        tests=(METRICS,),
    ),
    Mutant(
        name="metric-sums-overwritten",
        guarantee="a metric's sum adds up every batch",
        path="_epoch/_metrics.py",
        old="self.sum = value if self.sum is None else self.sum + value",
        new="self.sum = value",
        tests=(METRICS,),
    ),
    Mutant(
        name="metric-host-counts-overwritten",
        guarantee="a metric's count adds up every batch",
        path="_epoch/_metrics.py",
        old="self.host_count += float(count)",
        new="self.host_count = float(count)",
        tests=(METRICS,),
    ),
    Mutant(
        name="validation-metrics-of-the-root-only",
        guarantee="the validation metrics are summed over every rank in the pass's reduce",
        path="_epoch/_kernel.py",
        old="values = {} if metrics is None else metrics.values(meta[3:])",
        new="values = {} if metrics is None else metrics.values(metrics.local())",
        tests=(METRICS,),
    ),
    Mutant(
        name="torchmetrics-states-not-summed",
        guarantee="a torchmetrics metric computes on every rank's summed states",
        path="_epoch/_metrics.py",
        old="                setattr(metric, state, total)\n",
        new="                pass\n",
        tests=(METRICS,),
    ),
    Mutant(
        name="cat-states-accepted",
        guarantee="torchmetrics states that do not reduce by sum are refused",
        path="_metric.py",
        old="reduce is not dim_zero_sum:",
        new="reduce is None:",
        tests=(METRICS,),
    ),
    Mutant(
        name="pass-event-without-metrics",
        guarantee="a training pass's last event carries its metrics",
        path="_epoch/_watch.py",
        old="                    metrics=values,\n",
        new="",
        tests=(METRICS,),
    ),
    Mutant(
        name="monitor-mode-ignored",
        guarantee="a monitor in mode max prefers higher values",
        path="_monitor.py",
        old='        if self.mode == "min":\n',
        new="        if True:\n",
        tests=(MONITORS,),
    ),
    Mutant(
        name="min-delta-ignored",
        guarantee="early stopping counts an improvement only above min_delta",
        path="_monitor.py",
        old="return value - min_delta > (best",
        new="return value > (best",
        tests=(MONITORS,),
    ),
    Mutant(
        name="unreported-epochs-count",
        guarantee="early stopping counts only the epochs that report its value",
        path="_loop/_driver.py",
        old="    if value is None:\n        return state\n",
        new="    if value is None:\n        return attrs.evolve(state, wait=state.wait + 1)\n",
        tests=(MONITORS,),
    ),
    Mutant(
        name="no-early-stop",
        guarantee="the loop stops once early stopping runs out of patience",
        path="_loop/_driver.py",
        old="return rule is not None and stopping is not None and stopping.wait >= rule.patience",
        new="return False",
        tests=(MONITORS,),
    ),
    Mutant(
        name="early-stopping-state-not-loaded",
        guarantee="a checkpoint's early-stopping state comes back on resume",
        path="_state_json.py",
        old='else EarlyStoppingState(best=stopping["best"], wait=stopping["wait"]),',
        new="else None,",
        tests=(LOCAL_MONITORS,),
    ),
    Mutant(
        name="curve-metrics-not-checkpointed",
        guarantee="the learning curve's metrics are checkpointed",
        path="_state_json.py",
        old="    if point.metrics:\n",
        new="    if False:\n",
        tests=(LOCAL_MONITORS,),
    ),
    Mutant(
        name="schedule-sees-the-loss",
        guarantee="a schedule with a monitor gets the newest value it watches",
        path="_loop/_driver.py",
        old="                else _latest(state.learning_curve, loop.schedule_monitor)\n",
        new="                else state.last_validation_loss\n",
        tests=(MONITORS,),
    ),
    Mutant(
        name="plateau-mode-ignored",
        guarantee="reduce_on_plateau in mode max prefers higher values",
        path="schedules.py",
        old='sign = 1.0 if self.monitor.mode == "min" else -1.0',
        new="sign = 1.0",
        tests=(MONITORS,),
    ),
    Mutant(
        name="warmup-hides-the-monitor",
        guarantee="a wrapping schedule forwards its inner schedule's monitor",
        path="schedules.py",
        old="        return monitor if isinstance(monitor, Monitor) else None\n",
        new="        return None\n",
        tests=(MONITORS,),
    ),
    Mutant(
        name="best-model-by-the-loss",
        guarantee="the best model is chosen by best_model_monitor",
        path="_loop/_driver.py",
        old="    monitor = loop.rules.best_model_monitor\n",
        new="    monitor = _DEFAULT_MONITOR\n",
        tests=(LOCAL_MONITORS,),
    ),
    Mutant(
        name="metrics-not-agreed",
        guarantee="ranks with other metrics are refused before training",
        path="_roles/_agreement.py",
        old="    settings = [*_settings(options, validates), *metrics]\n",
        new="    settings = _settings(options, validates)\n",
        tests=(METRICS,),
    ),
    Mutant(
        name="shared-torchmetric-accepted",
        guarantee="in-process ranks may not share a torchmetrics object",
        path="_roles/_local.py",
        old="    _check_own_metrics(models_with_data_streams)\n",
        new="",
        tests=(METRICS,),
    ),
    Mutant(
        name="monitors-checked-late",
        guarantee="a monitor of a metric the model lacks is refused before training",
        path="_roles/_root.py",
        old="    check_monitors(loop, data)\n",
        new="",
        tests=(LOCAL_MONITORS,),
    ),
    Mutant(
        name="sharded-parameters-not-gathered",
        guarantee="sharded, every rank ends each step with every rank's stepped slice",
        path="_epoch/_designs/_sharded.py",
        old="        self._start_parameter_gathers()\n",
        new="",
        tests=(SHARDED,),
    ),
    Mutant(
        name="sharded-clipping-per-slice",
        guarantee="sharded, clipping uses the global norm over every rank's slice",
        path="_epoch/_stepper.py",
        old="        combine(squares)\n",
        new="",
        tests=(EXACTNESS + "::test_clipping_matches_clip_grad_norm_in_a_plain_loop",),
    ),
    Mutant(
        name="sharded-overflow-per-slice",
        guarantee="sharded, an fp16 overflow in any slice skips the step on every rank",
        path="_epoch/_stepper.py",
        old="            combine(overflowed)\n",
        new="            pass\n",
        tests=(EXACTNESS + "::test_sharded_fp16_loss_scaling_sees_an_overflow_in_any_slice",),
    ),
    Mutant(
        name="sharded-group-hyperparameters-lost",
        guarantee="sharded, each parameter group keeps its own hyperparameters",
        path="_epoch/_shard.py",
        old="                **_hyperparameters(group),\n",
        new="",
        tests=(SHARDED,),
    ),
    Mutant(
        name="sharded-state-not-gathered",
        guarantee="a sharded checkpoint holds the whole optimizer state",
        path="_epoch/_shard.py",
        old="        all_gather(whole, self.flat.shard(whole, self.rank))",
        new="        pass",
        tests=(RESUME,),
    ),
    Mutant(
        name="stream-state-not-loaded",
        guarantee="a resumed stream loads its source's state_dict",
        path="_epoch/_stream.py",
        old="iterable.load_state_dict(state)  # type: ignore[attr-defined]  # checked above",
        new="pass",
        tests=(STEPS,),
    ),
    Mutant(
        name="stream-position-not-restored",
        guarantee="a resumed rank goes on with the next batch of its data",
        path="_epoch/_pass.py",
        old="                self._start = mine.position",
        new="                pass",
        tests=(STEPS,),
    ),
    Mutant(
        name="per-step-schedule-ignored",
        guarantee="learning_rate_per_step scales every step's learning rate",
        path="_epoch/_kernel.py",
        old="stepper.set_lr_factor(lr_factor * factor_of(epoch * window + step))",
        new="stepper.set_lr_factor(lr_factor)",
        tests=(STEPS, CALLABLE_SCHEDULES),
    ),
    Mutant(
        name="rate-schedule-ignored",
        guarantee="schedules.rate sets each step's learning rates themselves",
        path="_epoch/_kernel.py",
        old="stepper.set_lr_rates(lr_factor, rate_of(epoch * window + step))",
        new="pass",
        tests=(CALLABLE_SCHEDULES,),
    ),
    Mutant(
        name="step-schedule-agreed-by-repr",
        guarantee="the ranks agree on a step schedule by the values it gives",
        path="_step_options.py",
        old="            return agreed_values(value, self.steps_per_epoch)",
        new="            return repr(value)",
        tests=(CALLABLE_SCHEDULES,),
    ),
    Mutant(
        name="checkpoint-interval-ignored",
        guarantee="checkpoint_interval checkpoints only once its time has passed",
        path="_roles/_run_state.py",
        old="        return time.monotonic() - self.last >= self.interval",
        new="        return True",
        tests=(STEPS,),
    ),
    Mutant(
        name="skipped-last-epoch-not-saved",
        guarantee="a loop that ends early saves the last epoch the interval skipped",
        path="_roles/_run_state.py",
        old="            await self.save(*self.unsaved)",
        new="            pass",
        tests=(STEPS,),
    ),
    Mutant(
        name="followers-rng-not-restored",
        guarantee="with restore_rng, every follower restores its own RNG states",
        path="_epoch/_pass.py",
        old='            if shared["restore_rng"] and self.rank != 0:',
        new="            if False:",
        tests=("tests/roles/test_tcp_steps.py",),
    ),
    Mutant(
        name="own-losses-not-gathered",
        guarantee="a non-finite summed loss names the ranks whose own loss was not finite",
        path="_epoch/_designs/_base.py",
        old="gather = self.all_gather if self.names_every_rank() else None",
        new="gather = None",
        tests=(NAMES_RANKS,),
    ),
    Mutant(
        name="followers-not-asked",
        guarantee="with step_on='root' the followers gather their own losses when the root asks",
        path="_epoch/_designs/_root.py",
        old="ask = non_finite is not None and self.non_finite.gather is not None",
        new="ask = False",
        tests=(NAMES_RANKS,),
    ),
    Mutant(
        name="cpu-checks-after-the-step",
        guarantee="on the CPU every stepping rank checks the summed loss at once, before stepping",
        path="_epoch/_designs/_exchanging.py",
        old='if must_read or self.device.type != "cuda":',
        new="if must_read:",
        tests=(NAMES_RANKS,),
    ),
    Mutant(
        name="skip-warning-unnamed",
        guarantee="the skip policy's warning names the ranks whose own loss was not finite",
        path="_epoch/_blame.py",
        old="            describe_losses(summed, losses, nranks=self.nranks),\n",
        new="            summed,\n",
        tests=(BLAME + "::test_the_skip_warning_names_the_ranks",),
    ),
    Mutant(
        name="alone-skips-unchecked",
        guarantee="a rank alone checks its loss before stepping and names itself",
        path="_epoch/_designs/_solo.py",
        old="        if not math.isfinite(value):\n",
        new="        if False:\n",
        tests=(BLAME + "::test_a_rank_alone_names_itself",),
    ),
    Mutant(
        name="batch-index-not-in-the-pass",
        guarantee="a model error names the batch's index in its pass",
        path="_epoch/_model_code.py",
        old="index = batch.number - self.first_batch",
        new="index = batch.number",
        tests=(BLAME + "::test_the_batch_index_counts_from_each_window",),
    ),
    Mutant(
        name="batch-shapes-unnamed",
        guarantee="a model error names the batch's shapes and dtypes",
        path="_epoch/_model_code.py",
        old='{type(exc).__name__}: {exc} "\n                f"({self._describe(batch)})",',
        new='{type(exc).__name__}: {exc} "\n                "",',
        tests=(BLAME + "::test_a_batch_of_the_wrong_shape_names_the_rank_batch_and_shapes",),
    ),
    Mutant(
        name="closure-optimizer-accepted",
        guarantee="an optimizer whose step needs a closure is refused before training",
        path="_epoch/_shard.py",
        old="    if closure is None or closure.default is not inspect.Parameter.empty:\n",
        new="    if True:\n",
        tests=(BLAME,),
    ),
    Mutant(
        name="closure-check-not-called",
        guarantee="every design checks the optimizer for a closure when it is built",
        path="_epoch/_designs/_base.py",
        old="    check_closure_free(rank, optimizer)\n",
        new="",
        tests=(BLAME + "::test_an_optimizer_that_needs_a_closure_is_refused_before_training",),
    ),
    Mutant(
        name="signal-hides-the-failure",
        guarantee="a failure is raised as it is, whatever signal follows it (torchrun)",
        path="_roles/_train.py",
        old="        if signals.received and abandoned_stop(exc):  # else a failure came first\n",
        new="        if signals.received:\n",
        tests=(
            "tests/test_launch.py",
            TORCHRUN + "::test_a_killed_follower_is_the_roots_error_not_a_graceful_stop",
        ),
    ),
    Mutant(
        name="stop-before-training-waits",
        guarantee="a stop before training began abandons the run at once",
        path="_roles/_stopping.py",
        old="        if tracker.current in BEFORE_TRAINING:\n",
        new="        if False:\n",
        tests=("tests/roles/test_stop.py",),
    ),
    Mutant(
        name="failed-follower-exits-last",
        guarantee="a follower that failed on its own exits before the root (torchrun's root cause)",
        path="_roles/_root.py",
        old=(
            "    if tracker.head_start_given or not isinstance(failure, RankFailed) or not "
            "failure.rank:\n"
        ),
        new="    if True:\n",
        tests=(
            TORCHRUN + "::test_a_batch_of_the_wrong_shape_names_the_follower_as_the_root_cause",
        ),
    ),
    Mutant(
        name="reported-follower-warns-of-the-root",
        guarantee="a follower that reported its own failure does not warn that the root left",
        path="control/_bookkeeping.py",
        old="        level = logging.DEBUG if self.reported else logging.WARNING\n",
        new="        level = logging.WARNING\n",
        tests=("tests/control/test_channels.py",),
    ),
    Mutant(
        name="fsdp-gradients-averaged",
        guarantee="under fsdp the ranks' gradients are summed, then divided by the examples",
        path="_epoch/_designs/_fsdp_model.py",
        old="unit.set_gradient_divide_factor(1.0)",
        new="unit.set_gradient_divide_factor(2.0)",
        tests=(FSDP + "::test_fsdp_matches_one_process",),
    ),
    Mutant(
        name="fsdp-clipping-by-own-shards",
        guarantee="under fsdp clipping uses the norm over every rank's shards",
        path="_epoch/_designs/_fsdp.py",
        old="    def combine(self) -> Combine:\n        return self._sum_over_clique",
        new="    def combine(self) -> Combine:\n        return lambda tensor: None",
        tests=(FSDP + "::test_fsdp_matches_one_process",),
    ),
    Mutant(
        name="fsdp-followers-keep-their-seed",
        guarantee="a meta-device model starts from the root's weights on every rank",
        path="_epoch/_designs/_fsdp.py",
        old="        self.clique.start_broadcast([seed]).wait_blocking(None)\n",
        new="",
        tests=(FSDP + "::test_a_model_built_on_the_meta_device_starts_from_the_roots_weights",),
    ),
    Mutant(
        name="fsdp-reduce-in-every-backward",
        guarantee="under fsdp accumulation reduces the gradients once a step",
        path="_epoch/_designs/_fsdp.py",
        old="self._set_gradient_sync(not anyone_ahead)",
        new="self._set_gradient_sync(True)",
        tests=(FSDP + "::test_accumulation_reduces_the_gradients_once_a_step",),
    ),
    Mutant(
        name="padding-counts-in-metrics",
        guarantee="a padding pass adds nothing to the metrics",
        path="_epoch/_model_code.py",
        old="metrics, self.metrics = self.metrics, None",
        new="metrics = self.metrics",
        tests=(FSDP + "::test_metrics_count_no_padding_pass",),
    ),
    Mutant(
        name="fsdp-resume-ignores-the-shards",
        guarantee="a resumed fsdp run loads each rank's part of the checkpoint",
        path="_epoch/_designs/_fsdp.py",
        old="                load_rank_shards(path, module, optimizer, rank=self.rank)\n",
        new="                pass\n",
        tests=(FSDP + "::test_checkpoints_reshard_between_rank_counts_and_designs",),
    ),
    Mutant(
        name="shards-not-checked-at-load",
        guarantee="a damaged or missing shard makes its checkpoint damaged",
        path="_checkpoint/_read.py",
        old="        if record.name != STATE and record not in stems.values():",
        new=(
            "        if record.name != STATE and record not in stems.values()"
            ' and "/" not in record.name:'
        ),
        tests=(FSDP + "::test_a_damaged_or_missing_shard_falls_back_to_the_previous_checkpoint",),
    ),
    Mutant(
        name="fsdp-peer-failure-blamed-on-the-model",
        guarantee="a peer that leaves during fsdp's in-model collectives is named, not the model",
        path="_epoch/_model_code.py",
        old="            if self.lockstep:",
        new="            if False:",
        tests=(FSDP + "::test_a_cancelled_root_ends_every_follower_naming_it",),
    ),
    Mutant(
        name="fsdp-timeout-blamed-on-the-model",
        guarantee="a collective of fsdp that times out inside the model is the clique's timeout",
        path="clique/_group_explain.py",
        old="        if _from_a_backend(exc):  # a collective of another group",
        new="        if False:",
        tests=(FSDP + "::test_a_stalled_follower_times_out_as_a_collective_not_as_the_model",),
    ),
    Mutant(
        name="recovery-keeps-the-live-state",
        guarantee="a recovery puts the root's model and optimizer back at the snapshot",
        path="_roles/_generations.py",
        old=(
            "        resume = await (self.state.load_snapshot() if back is None else "
            "self.state.load(back))\n"
        ),
        new="        resume = self.state.memory.held  # type: ignore[union-attr]\n",
        tests=(REFORMS,),
    ),
    Mutant(
        name="recovery-loads-the-snapshot-itself",
        guarantee="a second loss in a pass goes back to the snapshot, not to what was stepped",
        path="_roles/_run_state.py",
        old="        return attrs.evolve(self.held, training_state=_copied(state))",
        new="        return self.held",
        tests=(REFORMS,),
    ),
    Mutant(
        name="recovery-forgets-the-ranks-places",
        guarantee="every rank goes back to its place in its data and its RNG states",
        path="_roles/_generations.py",
        old="partial(self.state.settle, self.current(), resume)",
        new="partial(self.state.settle, self.current(), None)",
        tests=(KILLED + "[every_rank-windows]",),
    ),
    Mutant(
        name="abort-leaves-gloo-connections-open",
        guarantee="an abort ends a Gloo group's collectives at once, a stalled peer's too",
        path="clique/_group_abort.py",
        old="            ended = self._sockets.shut_down()",
        new="            ended = 0",
        tests=(FAULTS + "::test_fault[follower stopped (SIGSTOP) and left alone, then continued]",),
    ),
    Mutant(
        name="probe-of-a-closed-descriptor-raises",
        guarantee="a descriptor closed by another clique's thread does not fail a setup",
        path="clique/_sockets.py",
        old="    except OSError:  # closed meanwhile, or reused for what is not a socket\n"
        "        return False\n",
        new="    except OSError:  # closed meanwhile, or reused for what is not a socket\n"
        "        raise\n",
        tests=(
            "tests/clique/test_sockets.py::test_a_descriptor_closed_before_its_probe_is_not_noted",
        ),
    ),
    Mutant(
        name="reused-descriptor-noted",
        guarantee="a descriptor closed and reused for another socket is not the group's",
        path="clique/_sockets.py",
        old="            return False  # closed and reused for another socket meanwhile",
        new="            pass",
        tests=(
            "tests/clique/test_sockets.py"
            "::test_a_descriptor_reused_for_another_connection_is_neither_noted_nor_shut_down",
        ),
    ),
    Mutant(
        name="refused-join-raised-beside-the-stop",
        guarantee="a stop while the local loop's ranks join raises the root's stop alone",
        path="_roles/_failures.py",
        old="    CliqueTimeout,\n    JoinRejected,\n)",
        new="    CliqueTimeout,\n)",
        tests=(
            "tests/roles/test_stop.py"
            "::test_the_local_loop_stopped_while_its_ranks_join_raises_the_roots_stop_alone",
        ),
    ),
    Mutant(
        name="unresponsive-follower-left-running",
        guarantee="the root ends an unresponsive follower's process on its machine",
        path="_roles/_failures.py",
        old="    if clique is None or not isinstance(error, PeerUnresponsive) or not error.rank:",
        new="    if True:",
        tests=(
            ENDED,
            FAULTS + "::test_fault[follower stopped (SIGSTOP), 2 ranks, heartbeat_timeout 2 s]",
        ),
    ),
    Mutant(
        name="rank-0-leaves-before-its-followers",
        guarantee="rank 0's store closes only after its followers released their cliques",
        path="clique/_group_teardown.py",
        old="        if self._goodbye and self.rank == 0:",
        new="        if False:",
        tests=(
            "tests/clique/test_failures.py::"
            "test_rank_0_leaves_only_after_its_followers_have_released_their_cliques",
        ),
    ),
    Mutant(
        name="dead-store-asked-again",
        guarantee="a store found gone or stalled is not asked again (torch logs every failure)",
        path="clique/_store_link.py",
        old="        if keys is None or self.lost or not self._listens():",
        new="        if keys is None:",
        tests=(
            "tests/reliability/test_process_faults.py::"
            "test_a_dead_roots_store_costs_a_follower_one_warning_at_most",
        ),
    ),
    Mutant(
        name="unresponsive-reported-as-disconnected",
        guarantee="a follower found unresponsive is reported as PeerUnresponsive",
        path="_roles/_failures.py",
        old="        raise type(exc)(exc.message, rank=exc.rank, phase=tracker.current) from None",
        new="        raise PeerDisconnected(exc.message, rank=exc.rank, phase=tracker.current)",
        tests=(
            FAULTS + "::test_fault[follower stopped (SIGSTOP), 2 ranks, heartbeat_timeout 2 s]",
        ),
    ),
    Mutant(
        name="survivor-ignores-the-roots-hold",
        guarantee="a follower whose collective broke waits for the root's HOLD",
        path="_roles/_follower.py",
        old="""                if command.kind is CommandKind.HOLD:
                    return command
                if command.kind is CommandKind.STOP:""",
        new="""                if command.kind is CommandKind.STOP:""",
        tests=(KILLED,),
    ),
    Mutant(
        name="replacement-refusal-ends-the-run",
        guarantee="a replacement that fails the agreement check is refused and the root waits",
        path="_roles/_generations.py",
        old="            except MismatchError as refused:",
        new="            except ZeroDivisionError as refused:",
        tests=(
            RECOVERY
            + "::test_a_replacement_that_disagrees_is_refused_and_the_root_waits_for_another",
        ),
    ),
    Mutant(
        name="recoveries-unbounded",
        guarantee="more losses than max_recoveries end the run",
        path="_roles/_generations.py",
        old="        if self.recoveries > recovery.max_recoveries:",
        new="        if False:",
        tests=(RECOVERY + "::test_recoveries_beyond_max_recoveries_end_the_run",),
    ),
    Mutant(
        name="norm-of-the-local-slice",
        guarantee="sliced designs report the global gradient norm over every rank's slices",
        path="_epoch/_stepper.py",
        old="        combine(squares)\n        norm = squares.sqrt()",
        new="        norm = squares.sqrt()",
        tests=(TELEMETRY + "::test_gradient_norm_is_clip_grad_norm_of_the_concatenated_batches",),
    ),
    Mutant(
        name="norm-after-clipping",
        guarantee="the gradient norm is the one before clipping",
        path="_epoch/_stepper.py",
        old="self._keep_norm(torch.nn.utils.clip_grad_norm_(self.flat.parameters, max_norm))",
        new=(
            "torch.nn.utils.clip_grad_norm_(self.flat.parameters, max_norm)\n"
            "                self._keep_norm(torch.nn.utils.get_total_norm("
            "[p.grad for p in self.flat.parameters if p.grad is not None]))"
        ),
        tests=(TELEMETRY + "::test_gradient_norm_is_clip_grad_norm_of_the_concatenated_batches",),
    ),
    Mutant(
        name="backward-timed-as-data",
        guarantee="the step split puts forward and backward in their own part",
        path="_epoch/_kernel.py",
        old="            clock.mark(FORWARD_BACKWARD)\n            return loss",
        new="            clock.mark(DATA)\n            return loss",
        tests=(TELEMETRY,),
    ),
    Mutant(
        name="idle-between-steps-lost",
        guarantee="the step split covers the whole step (the time between steps is idle)",
        path="_epoch/_clock.py",
        old="            self._totals[IDLE] += now - self._last\n",
        new="            pass\n",
        tests=(TELEMETRY + "::test_the_host_clock_gives_every_stretch_to_a_part",),
    ),
    Mutant(
        name="no-straggler-margin",
        guarantee="a straggler is a rank more than the margin slower than the others",
        path="_epoch/_telemetry.py",
        old="if excess <= STRAGGLER_MARGIN * median or excess / steps < _MIN_EXCESS:",
        new="if excess < 0:",
        tests=(TELEMETRY + "::test_a_straggler_is_more_than_the_margin_slower_than_the_others",),
    ),
    Mutant(
        name="straggler-held-to-the-roots-optimizer",
        guarantee="under step_on='root' the root's optimizer step is no straggler's",
        path="_epoch/_telemetry.py",
        old="    parts = _STEPPING_PARTS if every_rank_steps else _OWN_PARTS",
        new="    parts = _STEPPING_PARTS",
        tests=(TELEMETRY + "::test_under_the_root_design_the_roots_optimizer_is_no_straggler",),
    ),
    Mutant(
        name="straggler-design-not-wired",
        guarantee="the pass's watch judges stragglers by what the design's ranks do alike",
        path="_epoch/_watch.py",
        old="Stragglers(every_rank_steps=design.followers_step)",
        new="Stragglers(every_rank_steps=True)",
        tests=(TELEMETRY + "::test_a_healthy_run_of_the_default_design_names_no_straggler",),
    ),
    Mutant(
        name="straggler-against-itself",
        guarantee="the slowest rank is compared with the other ranks, not with itself among them",
        path="_epoch/_telemetry.py",
        old="    others = [s for s in split if s is not slowest]",
        new="    others = list(split)",
        tests=(TELEMETRY + "::test_with_two_ranks_a_straggler_is_compared_with_the_other_rank",),
    ),
    Mutant(
        name="straggler-after-one-pass",
        guarantee="a straggler is named after passes in a row only",
        path="_epoch/_telemetry.py",
        old="        if self._streak % STRAGGLER_PASSES:",
        new="        if False:",
        tests=(TELEMETRY + "::test_a_straggler_is_named_after_passes_in_a_row_only",),
    ),
    Mutant(
        name="tokens-of-the-root-only",
        guarantee="a pass's tokens are summed over every rank",
        path="_epoch/_telemetry.py",
        old="    return round(sum(row[6] for row in rows))",
        new="    return round(rows[0][6])",
        tests=(TELEMETRY + "::test_tokens_are_the_integer_targets_elements_over_every_rank",),
    ),
    Mutant(
        name="mfu-of-one-device",
        guarantee="MFU is over the peak of every rank's device",
        path="_epoch/_watch.py",
        old="telemetry.peak_flops = None if peak is None else peak * nranks",
        new="telemetry.peak_flops = peak",
        tests=(TELEMETRY + "::test_mfu_from_counted_flops_and_a_peak_from_the_environment",),
    ),
    Mutant(
        name="steps-not-noted",
        guarantee="a collective timeout's account names the step every rank is at",
        path="_epoch/_kernel.py",
        old='            clique.at_step(epoch, "train", step)\n',
        new="",
        tests=(FSDP + "::test_a_stalled_follower_times_out_as_a_collective_not_as_the_model",),
    ),
]


def run(mutant: Mutant) -> tuple[str, float]:
    """``"killed"``, ``"survived"`` or ``"error: ..."``, and the seconds its tests took."""
    with tempfile.TemporaryDirectory(prefix="lampdist-mutant-") as scratch:
        copy = Path(scratch) / "src"
        shutil.copytree(SOURCE, copy, ignore=shutil.ignore_patterns("__pycache__"))
        target = copy / "lampdist" / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            return f"error: the snippet occurs {text.count(mutant.old)} times", 0.0
        target.write_text(text.replace(mutant.old, mutant.new))
        environment = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
        started = time.monotonic()
        try:
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-x",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-n",  # one process: -x stops at the first failure
                    "0",
                    "--run-slow",  # a mutant's tests run whether marked slow or not
                    *mutant.tests,
                ],
                cwd=ROOT,
                env=environment,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return "killed (timed out)", time.monotonic() - started
        seconds = time.monotonic() - started
        if result.returncode == 1:
            return "killed", seconds
        if result.returncode == 0:
            return "survived", seconds
        return f"error: pytest exited {result.returncode}\n{result.stdout[-2000:]}", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="the mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name}: {mutant.guarantee} ({mutant.path})")
        return 0
    bad = 0
    for mutant in chosen:
        outcome, seconds = run(mutant)
        print(f"{mutant.name:34} {outcome.splitlines()[0]:20} {seconds:6.1f} s  {mutant.guarantee}")
        if not outcome.startswith("killed"):
            bad += 1
            if "\n" in outcome:
                print(outcome)
    print(f"{len(chosen) - bad} of {len(chosen)} mutants killed")
    return bad


if __name__ == "__main__":
    sys.exit(main())
