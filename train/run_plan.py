"""The plan of a run's output directory, made before any model loads (docs/reliability.md).

Before any model loads, `prepare_output_dir` decides what a run does with its output_dir:
start fresh, resume a checkpoint (whose recipe must not differ in a way that changes the
trained draft), report a finished run, or refuse. The helpers below keep the directory and
its log clean: leftovers of an interrupted atomic publish, the resumed γ keys, quiet saves,
plain progress lines when the log is not a terminal.
"""

import ast
import json
import logging
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import logging as hf_logging

from specdistill import publish
from specdistill.errors import UserError
from specdistill.models.weights import check_state_file
from specdistill.train.config import Recipe, RecipeError, load_run_recipe, recipe_to_dict
from specdistill.train.recipe import harmless_keys

CHECKPOINT_PREFIX = "step-"

STATE_FILE = "trainer_state.json"
# Recipe keys a resumed run may change: they do not change the trained draft (the schema marks
# them, train/recipe.py). Everything else (target, draft, data, loss, the rest of train, the
# seed) does, and is refused.
HARMLESS_KEYS = harmless_keys()
HARMLESS_SECTIONS = ("eval.", "wandb.", "online.")  # distill ignores online.
# Where accelerate logs "Removed shared tensor ... while saving" (clean_state_dict_for_safetensors)
ACCELERATE_SAVE_LOGGER = "accelerate.utils.other"


class CheckpointError(UserError):
    """No checkpoint to resume from could be loaded; the message names each one and why."""


@dataclass
class RunPlan:
    """What `prepare_output_dir` decided, before any model is loaded."""

    out: Path
    resume_from: list[Path]  # checkpoints to try, newest first (then older ones); [] = fresh
    finished: dict | None = None  # eval.json of a complete run of this recipe: nothing to do
    clear: bool = False  # train.overwrite=true on a non-empty output_dir


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in `out`, oldest first (a partial one is still a .tmp-* dir)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix(CHECKPOINT_PREFIX))


def check_checkpoint_weights(checkpoint: Path, model) -> None:
    """Before a checkpoint is loaded into `model` (the draft as accelerate prepared it):
    its model.safetensors must hold exactly the model's tensors, with their shapes, else
    `IncompleteDraftError` names the missing / unexpected / other-shaped ones (a file cut
    short is a `BrokenWeightsError`). A sharded (FSDP) checkpoint has no such file and is
    left to accelerate."""
    weights = checkpoint / "model.safetensors"
    if weights.is_file():
        check_state_file(
            weights,
            model.state_dict(),
            advice="it was saved from another draft, or is damaged",
        )


def _check_parents(out: Path) -> None:
    """RecipeError when the nearest existing directory above `out` is a file (or anything
    but a directory): the run could never create its output_dir there."""
    for parent in out.absolute().parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise RecipeError(
                    f"train.output_dir {out} lies under {parent}, which is not a directory; "
                    "choose a train.output_dir under a directory"
                )
            return


def prepare_output_dir(recipe: Recipe) -> RunPlan:
    """Check train.output_dir and train.resume against each other and against what is on disk,
    before any model or data is loaded (minutes on a real model) and before anything is
    written: a run that cannot go on must fail at once and leave an earlier run untouched.

    A non-empty output_dir is refused unless the run resumes (train.resume=auto or a path) or
    replaces it (train.overwrite=true): two runs in one directory would mix their metrics,
    final/ and checkpoints. A run resumes only a checkpoint whose recipe differs from this one
    in keys that do not change the trained draft (`recipe_changes`). With train.resume=auto,
    a run that is already complete is reported as `finished` instead of trained again.
    """
    t = recipe.train
    out = Path(t.output_dir)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"train.output_dir {out} exists and is not a directory")
    _check_parents(out)
    used = out.is_dir() and any(out.iterdir())
    if t.resume not in ("no", "auto"):
        path = Path(t.resume)
        if not (path / STATE_FILE).is_file():
            raise RecipeError(
                f"train.resume: {path} is not a checkpoint directory (it has no {STATE_FILE}); "
                f"name one of {out / 'checkpoints'}/{CHECKPOINT_PREFIX}*, or pass "
                "train.resume=auto for the newest one"
            )
        if t.overwrite and out.resolve() in (path.resolve(), *path.resolve().parents):
            raise RecipeError(
                f"train.overwrite=true would delete train.resume={path}: it lies in "
                f"train.output_dir {out}"
            )
        check_recipe(path / "recipe.yaml", recipe)
        return RunPlan(out, [path], clear=used and t.overwrite)
    if t.overwrite or not used:
        return RunPlan(out, [], clear=used)
    if t.resume == "no":
        raise RecipeError(
            f"train.output_dir {out} is not empty (it holds an earlier run); pass "
            "train.resume=auto to continue that run, or train.overwrite=true to delete it and "
            "start over (or choose another train.output_dir)"
        )
    found = list_checkpoints(out)[::-1]
    for path in found:
        check_recipe(path / "recipe.yaml", recipe)
    if not found:
        if not (out / "recipe.yaml").is_file():
            raise RecipeError(
                f"train.resume=auto: train.output_dir {out} is not empty but holds no run "
                "(no recipe.yaml, no checkpoint); pass train.overwrite=true to delete its "
                "contents, or choose another train.output_dir"
            )
        check_recipe(out / "recipe.yaml", recipe)
    report = _read_report(out)
    if report is not None and report.get("steps") == t.max_steps:
        return RunPlan(out, found, finished=report)
    if report is not None and not found:
        raise RecipeError(
            f"train.resume=auto: {out} holds a finished run of {report.get('steps')} steps and "
            f"no checkpoint to continue it to train.max_steps={t.max_steps} from; pass "
            "train.overwrite=true to train again from the start"
        )
    return RunPlan(out, found)


def _read_report(out: Path) -> dict | None:
    """eval.json of a complete run in `out`: written last, after final/
    (train/outputs.py `Outputs.save_final`)."""
    if not (out / "final").is_dir():
        return None
    try:
        return json.loads((out / "eval.json").read_text())
    except (OSError, ValueError):
        return None


def check_recipe(saved: Path, recipe: Recipe) -> list[str]:
    """Refuse to continue the run whose recipe is `saved` if `recipe` differs from it in a key
    that changes the trained draft; return the harmless changes ('key: old → new')."""
    try:
        old = load_run_recipe(saved)
    except RecipeError as e:
        raise RecipeError(f"train.resume: cannot read the run's recipe {saved}: {e}") from None
    altering, harmless = recipe_changes(old, recipe)
    if altering:
        raise RecipeError(
            f"train.resume: the run in {saved.parent} was trained with a different recipe; "
            f"these changes would alter the trained draft: {'; '.join(altering)}. Resume "
            "with the run's values, or start a new run (another train.output_dir, or "
            "train.overwrite=true)"
        )
    return harmless


def recipe_changes(old: Recipe, new: Recipe) -> tuple[list[str], list[str]]:
    """(changes that alter the trained draft, changes that do not), each 'key: old → new'.

    train.max_steps may grow (the run trains on; the cosine schedule stretches from the
    resumed step), not shrink: the checkpoint may already be past the new end.
    """
    a, b = _flatten(recipe_to_dict(old)), _flatten(recipe_to_dict(new))
    altering, harmless = [], []
    for key in [*b, *(k for k in a if k not in b)]:
        before, after = a.get(key, "<unset>"), b.get(key, "<unset>")
        if before == after:
            continue
        line = f"{key}: {before} → {after}"
        if key == "train.max_steps":
            (harmless if after > before else altering).append(line)
        elif key in HARMLESS_KEYS or key.startswith(HARMLESS_SECTIONS):
            harmless.append(line)
        else:
            altering.append(line)
    return altering, harmless


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def restore_int_keys(metrics: dict | None) -> dict | None:
    """JSON turns the integer γ keys of tau_pred into strings ("5"); give them back, so that
    `tau_pred[5]` works on a result read from trainer_state.json or eval.json."""
    if metrics is None:
        return None
    return {
        key: {int(g): t for g, t in value.items()}
        if key.startswith("tau_pred") and isinstance(value, dict)
        else value
        for key, value in metrics.items()
    }


def remove_leftovers(out: Path) -> None:
    """Delete what a kill left of an atomic publish in the run directory and its
    checkpoints (specdistill/publish.py `remove_leftovers`). None of them is ever read."""
    for folder in (out, out / "checkpoints"):
        publish.remove_leftovers(folder)


def progress_line(record: dict, max_steps: int) -> str:
    """One plain log line, for a log that is not a terminal (a progress bar's carriage-return
    redraws would fill it with hundreds of partial lines)."""
    return (
        f"step {record['step']}/{max_steps} | loss {record['loss']:.4f} | "
        f"alpha {record['alpha']:.4f} | lr {record['lr']:.2e} | {record['elapsed_s']:.1f} s"
    )


class TiedHeadWarningFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving" when the removed tensors
    are exactly the draft's output head tied to its input embeddings. safetensors cannot store
    one tensor twice, and from_pretrained / load_state tie the head again, so for a tied head
    the warning is noise printed at every checkpoint. Any other removed tensor still warns."""

    PATTERN = re.compile(r"Removed shared tensor (\{.*?\}) while saving")

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.PATTERN.search(record.getMessage())  # after accelerate's "[RANK i] "
        return match is None or not ast.literal_eval(match.group(1)) <= self.names


def tied_head_names(model) -> set[str]:
    """State-dict names of `model`'s output head weight when it is the input embedding matrix,
    with and without DDP's "module." prefix (accelerate saves the wrapped model)."""
    try:
        head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return set()
    names = {f"{name}.weight" for name, module in model.named_modules() if module is head}
    return names | {f"module.{name}" for name in names}


@contextmanager
def quiet_library_bars():
    """No transformers / hub progress bars ("Loading weights", "Writing model shards") while
    stderr is not a terminal: in a log file each one is a line of carriage-return redraws."""
    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


@contextmanager
def quiet_tied_head_warning(model):
    """While saving `model`: no "Removed shared tensor" warning for its tied output head."""
    noise = TiedHeadWarningFilter(tied_head_names(model))
    logger = logging.getLogger(ACCELERATE_SAVE_LOGGER)
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)
