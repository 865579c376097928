"""A run's directory on disk: its first writes, what a kill left behind, its logs, and its
checkpoints, for the offline run (train/trainer.py) and the online job (train/online/job.py)
alike.

One checkpoint format: a directory holding the step core's state as accelerate saves it
(the draft's weights in safetensors, the optimiser, the learning-rate schedule, the RNG
states; `DistillStep.save_state`), the driver's own state in trainer_state.json (always with
the step counter "step") and the recipe (recipe.yaml). It is written to a temporary folder,
flushed and renamed into place (specdistill/publish.py `publish_dir`), so that neither a kill
nor a crash of the machine leaves half a checkpoint under its name.

Logs are append-only JSON lines; a checkpoint records their sizes, and a resume cuts them
back to those sizes (`truncate_log`), so that the logs of a killed and resumed run equal an
uninterrupted run's.

Crash tests inject `faults`, a callable given the name of each point a commit passes
("commit:before", "commit:written", "commit:after"); it is a no-op otherwise.
"""

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specdistill import publish
from specdistill.train.config import dump_recipe, load_run_recipe
from specdistill.train.run_plan import (
    CHECKPOINT_PREFIX,
    STATE_FILE,
    CheckpointError,
    list_checkpoints,
    recipe_changes,
)

Faults = Callable[[str], None]


def no_faults(point: str) -> None:
    """The fault hook of a real run: nothing happens at any point."""


def truncate_log(path: Path, size: int) -> None:
    """Cut the log `path` back to its first `size` bytes (nothing when it is not longer)."""
    if path.exists() and path.stat().st_size > size:
        os.truncate(path, size)


def read_state(checkpoint: Path) -> dict:
    """The driver's state stored in a checkpoint (trainer_state.json)."""
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


class RunDir:
    """The directory `out` of one run; `accelerator` says which process writes (the main
    one) and where all of them wait for each other."""

    def __init__(self, out, accelerator, *, faults: Faults = no_faults):
        self.out, self.accelerator, self.faults = Path(out), accelerator, faults

    # ----------------------------------------------------------------------------- start
    def start(self, *, clear: bool, say=print) -> None:
        """The first writes of a run: with `clear`, delete the directory's contents; create
        it; delete what a kill left of an atomic publish (`recover`)."""
        acc = self.accelerator
        if acc.is_main_process:
            if clear:
                say(f"train.overwrite=true: deleting the contents of {self.out}")
                for entry in self.out.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
            self.out.mkdir(parents=True, exist_ok=True)
            self.recover()
        acc.wait_for_everyone()

    def recover(self, state: str | None = None) -> None:
        """Delete what a kill left of an atomic publish in the directory and its checkpoints
        (specdistill/publish.py `remove_leftovers`). With `state` (the name of a checkpoint
        replaced in place, like the online job's OUT/state): a kill between publish_dir's two
        renames left only .old-<state>-*; it is renamed back first."""
        if state is not None:
            olds = sorted(self.out.glob(f".old-{state}-*"))
            if not (self.out / state).exists() and olds:
                os.replace(olds[-1], self.out / state)
        for folder in (self.out, self.out / "checkpoints"):
            publish.remove_leftovers(folder)

    # ----------------------------------------------------------------------------- logs
    def append(self, name: str, record: dict) -> None:
        """One JSON line at the end of the log `name`."""
        with open(self.out / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log_sizes(self, names) -> dict[str, int]:
        return {n: (self.out / n).stat().st_size if (self.out / n).exists() else 0 for n in names}

    def truncate_logs(self, sizes: dict[str, int]) -> None:
        for name, size in sizes.items():
            truncate_log(self.out / name, size)

    def trim_metrics(self, resumed: tuple[Path, dict] | None, say=print) -> None:
        """Cut metrics.jsonl back to what it held when the resumed checkpoint was saved (its
        "metrics_bytes"); without that size (an older checkpoint, or one of another run
        directory), keep the lines up to the checkpoint's step. No checkpoint: the log of a
        killed attempt, deleted."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        if resumed is None:  # resume=auto found no checkpoint: the log of a killed attempt
            say(f"no checkpoint in {self.out}: starting the run afresh")
            path.unlink()
            return
        checkpoint, state = resumed
        size = state.get("metrics_bytes")
        ours = checkpoint.resolve().parent.parent == self.out.resolve()
        if size is not None and ours and path.stat().st_size >= size:
            truncate_log(path, size)
            return
        kept = []
        for line in path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the kill
            if step <= state["step"]:
                kept.append(line)
        publish.atomic_write_text(path, "".join(kept))

    # ----------------------------------------------------------------------------- checkpoints
    def commit(self, dest: Path, core, state: dict, recipe) -> None:
        """Write a checkpoint of `core` with the driver's `state` (JSON; "step" is added) and
        `recipe` at `dest`, replacing what is there in one rename. Every process calls it."""
        acc = self.accelerator
        self.faults("commit:before")
        tmp = dest.parent / f".tmp-{dest.name}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        core.save_state(tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {"step": core.step, **state, "time": time.time()}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            dump_recipe(recipe, tmp / "recipe.yaml")
            self.faults("commit:written")
            publish.publish_dir(tmp, dest)
            self.faults("commit:after")
        acc.wait_for_everyone()

    def load(self, checkpoint: Path, core) -> dict:
        """Load a checkpoint into `core`; returns the driver's state. Raises whatever a
        damaged file raises (safetensors, pickle, JSON) or `IncompleteDraftError`."""
        state = read_state(checkpoint)
        core.load_state(checkpoint, step=state["step"])
        return state

    def save_checkpoint(self, core, state: dict, recipe) -> None:
        """checkpoints/step-NNNNNNN of the offline run (`commit`); the oldest beyond
        train.keep_checkpoints are deleted."""
        name = f"{CHECKPOINT_PREFIX}{core.step:07d}"
        self.commit(self.out / "checkpoints" / name, core, state, recipe)
        if self.accelerator.is_main_process:
            for old in list_checkpoints(self.out)[: -recipe.train.keep_checkpoints]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()

    def resume(self, core, checkpoints: list[Path], recipe, say=print) -> tuple[Path, dict] | None:
        """Load the first of `checkpoints` (newest first) that loads into `core`: (its path,
        the driver's state), or None when there is none. A checkpoint that fails to load (a
        file cut short by a crash, a disk error, weights that do not match the draft:
        `check_checkpoint_weights` names the tensors) is named and the previous one is
        tried: losing a few steps beats losing the run, and saying so beats a bare
        safetensors error. A CheckpointError when none loads."""
        failures = []
        for path in checkpoints:
            try:
                state = self.load(path, core)
            except Exception as e:  # whatever a damaged file raises: safetensors, pickle, JSON
                failures.append(f"{path} ({type(e).__name__}: {e})")
                say(
                    f"warning: cannot load checkpoint {path} ({type(e).__name__}: {e}); "
                    "skipping it",
                    file=sys.stderr,
                )
                continue
            if failures:
                say(
                    f"warning: resuming from the previous complete checkpoint {path} instead",
                    file=sys.stderr,
                )
            say(f"resumed from {path} at step {core.step}")
            harmless = recipe_changes(load_run_recipe(path / "recipe.yaml"), recipe)[1]
            if harmless:
                say(
                    "recipe changes since that checkpoint (they do not alter the trained "
                    "draft): " + "; ".join(harmless)
                )
            return path, state
        if failures:
            raise CheckpointError(
                "no checkpoint could be loaded: "
                + "; ".join(failures)
                + ". Delete the damaged ones to resume from an earlier checkpoint, or pass "
                "train.overwrite=true to start over"
            )
        return None
