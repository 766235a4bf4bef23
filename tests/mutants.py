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
RESUME = "tests/roles/test_local_resume.py"
DRIVER = "tests/loop/test_driver.py"

MUTANTS = [
    Mutant(
        name="gradients-not-averaged",
        guarantee="the gradient is the example-weighted average over every rank",
        path="_epoch/_stepper.py",
        old="divisor = (1.0 if averaged else examples) * self.loss_scale.factor",
        new="divisor = 1.0 * self.loss_scale.factor",
        tests=(EXACTNESS,),
    ),
    Mutant(
        name="batches-weighted-equally",
        guarantee="each batch's loss is weighted by its example count",
        path="_epoch/_kernel.py",
        old='loss = self._weighted_loss(batch, "train", epoch, weight=batch.examples)',
        new='loss = self._weighted_loss(batch, "train", epoch, weight=1)',
        tests=(EXACTNESS,),
    ),
    Mutant(
        name="no-accumulation",
        guarantee="accumulate_gradient_over_n_batches batches make one step",
        path="_epoch/_kernel.py",
        old="accumulate = self.options.accumulate_gradient_over_n_batches\n        for index",
        new="accumulate = 1\n        for index",
        tests=(EXACTNESS,),
    ),
    Mutant(
        name="no-clipping",
        guarantee="max_grad_norm clips the averaged gradients by their global norm",
        path="_epoch/_stepper.py",
        old=(
            "            if self.options.max_grad_norm is not None:\n"
            "                torch.nn.utils.clip_grad_norm_(self.flat.parameters, "
            "self.options.max_grad_norm)\n"
            "            self.optimizer.step()\n            return True"
        ),
        new="            self.optimizer.step()\n            return True",
        tests=(f"{EXACTNESS}::test_clipping_matches_clip_grad_norm_in_a_plain_loop",),
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
        old="epoch % validation_frequency == 0",
        new="epoch % validation_frequency != 0",
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
        guarantee="the best model is the first epoch with the strictly lowest smoothed loss",
        path="_loop/_driver.py",
        old="if epoch in save_epochs and smoothed < lowest:",
        new="if epoch in save_epochs and smoothed <= lowest:",
        tests=(DRIVER,),
    ),
    Mutant(
        name="best-model-outside-its-epochs",
        guarantee="only epochs in return_min_validation_loss_model can be the best model",
        path="_loop/_driver.py",
        old="if epoch in save_epochs and smoothed < lowest:",
        new="if smoothed < lowest:",
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
        path="_roles/_root.py",
        old="        self.data.model.module.load_state_dict(state.model_state)\n",
        new="",
        tests=(RESUME, "tests/roles/test_resume_from_disk.py"),
    ),
    Mutant(
        name="resume-ignores-the-optimizer",
        guarantee="a resumed run continues from the checkpoint's optimizer state",
        path="_roles/_root.py",
        old="        self.stepper.optimizer.load_state_dict(dict(state.optimizer_state))\n",
        new="",
        tests=(RESUME,),
    ),
    Mutant(
        name="resume-restarts-at-epoch-0",
        guarantee="a resumed run trains only the epochs left",
        path="_roles/_root.py",
        old="            loop_state = self.resume.training_state.loop_state\n",
        new="",
        tests=(RESUME, "tests/reliability/test_local_faults.py"),
    ),
    Mutant(
        name="checksums-not-verified",
        guarantee="load_latest skips a damaged checkpoint (every file checked)",
        path="_checkpoint/_read.py",
        old="            _check(path, record, manifest.checksum)\n",
        new="            pass\n",
        tests=("tests/checkpoint/test_checkpoint.py",),
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
