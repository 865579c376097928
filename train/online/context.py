"""What the parts of the online job share: `Context`, built once by the job
(train/online/job.py) and handed to each part: the intake (intake.py), the served side
(served.py) and the refreshes (refresh.py). It holds what no part owns alone (the recipe,
OUT and ROOT, the frozen target, the step core, the store, the counters, the printer and
the crash-test hook); each part keeps the rest of its state in its own declared fields."""

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from specdistill import drafts
from specdistill.data.dataset import TokenDataset
from specdistill.models.identity import model_identity
from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer
from specdistill.train.batches import accumulation_steps
from specdistill.train.online.screen import load_anchor
from specdistill.train.online.store import Store
from specdistill.train.recipe import Recipe
from specdistill.train.recipe_errors import RecipeError
from specdistill.train.recipe_online import OnlineConfig
from specdistill.train.run_dir import Faults
from specdistill.train.step import DistillStep


@dataclass(frozen=True, eq=False)
class Context:
    """The online job's shared state. The fields are never reassigned; `store` and `counts`
    change in place (the intake files records and counts them, a refresh trains them)."""

    recipe: Recipe  # the job's own copy: constant learning rate, OSD's buffer (job_recipe)
    out: Path  # OUT (online.output_dir): state/ and the logs
    root: Path  # ROOT (online.drafts): the published versions
    target: torch.nn.Module  # frozen; the step core holds the same model
    tokenizer: object
    identity: str  # the target's identity (models/identity.py), as the server computes it
    vocab_size: int  # len(tokenizer): the ids a record may hold
    core: DistillStep  # the running draft, its optimiser, the step (train/step.py)
    store: Store  # recent, reservoir, anchor, held-out (store.py)
    counts: Counter  # the job's counters: committed in OUT/state, reported by the summary
    print: Callable[..., None]
    faults: Faults  # the crash-test hook (tests only; a no-op otherwise)

    @property
    def online(self) -> OnlineConfig:
        return self.recipe.online

    def log(self, name: str, record: dict) -> None:
        """Append `record` to OUT/`name` (one of dirs.LOGS) as a JSON line."""
        with open(self.out / name, "a") as f:
            f.write(json.dumps(record) + "\n")


def max_tokens(recipe: Recipe) -> int:
    """The token budget of one record (prompt and completion)."""
    return recipe.online.max_record_tokens or recipe.data.max_length


def build_context(recipe: Recipe, *, print: Callable[..., None], faults: Faults) -> Context:
    """Load the target (with the recipe's target.adapter, which is part of the target: the
    identity covers its files, as the server's does, so records of the bare base or of
    another adapter are refused), the anchor set and the draft; make the step core and the
    store."""
    r, o = recipe, recipe.online
    target, tokenizer = load_target_and_tokenizer(TargetSpec.from_recipe(r.target))
    identity = model_identity(r.target.model, target, r.target.adapter)
    vocab_size = len(tokenizer)
    anchor = load_anchor(o.anchor, identity, max_tokens(r), vocab_size)
    data = vocab_data(r, vocab_size, anchor)
    draft, kind = drafts.build(r.draft, target, tokenizer, data, print=lambda *a: None)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    accumulation_steps(r, acc)  # the global batch splits into micro-batches
    core = DistillStep(r, accelerator=acc, target=target, draft=draft, kind=kind)
    store = Store(
        o.recent_size,
        o.reservoir_size,
        o.holdout_size,
        o.dedup_size,
        o.max_per_prompt,
        rng_state=r.train.seed,
    )
    store.anchor = anchor
    return Context(
        recipe=r,
        out=Path(o.output_dir),
        root=Path(o.drafts),
        target=target,
        tokenizer=tokenizer,
        identity=identity,
        vocab_size=vocab_size,
        core=core,
        store=store,
        counts=Counter(),
        print=print,
        faults=faults,
    )


def vocab_data(recipe: Recipe, vocab_size: int, anchor: list) -> TokenDataset | None:
    """What a fresh EAGLE-3 head (draft.model null) builds its V_d from: the anchor set's
    completion tokens. None where nothing is needed (a standalone draft, a trained head,
    or V_d = V); a RecipeError where a V_d < V has nothing to be built from."""
    d = recipe.draft
    if not drafts.planned(d).capabilities.fresh or d.model is not None:
        return None
    if d.vocab_size is None or d.vocab_size >= vocab_size:
        return None
    if not anchor:
        raise RecipeError(
            "specdistill online with draft.type=eagle3: draft.model must be a trained "
            "EAGLE-3 head directory (e.g. from specdistill distill), or a fresh head needs "
            "draft.vocab_size null (V_d = V) or an online.anchor set to build its draft "
            "vocabulary from"
        )
    return TokenDataset([it.tokens() for it in anchor], n_records=len(anchor), skipped={})
