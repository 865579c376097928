"""The recipe checks that relate several keys: what the recipe asks of its draft type,
against the capabilities the type declares (`drafts.types.Capabilities`, of the type the
`draft` section trains: `drafts.planned`), and the checks across sections. The loss section
is checked and resolved by train/recipe_loss.py, in the middle: the checks of its chain part
need it resolved.

Each key's own type and range is the schema's (train/recipe.py); what is here cannot be said
of one key alone. Every message names the keys and what to do.
"""

import os
from typing import TYPE_CHECKING

from specdistill.bounds import max_threads
from specdistill.train.recipe import Recipe
from specdistill.train.recipe_errors import RecipeError
from specdistill.train.recipe_loss import resolved_loss

if TYPE_CHECKING:
    # lazy: for the type hints only (the drafts load torch)
    from specdistill.drafts.types import Capabilities
    from specdistill.losses.resolved import ResolvedLoss  # lazy: for the type hints only

Check = tuple[bool, str]


def validate(recipe: Recipe) -> "ResolvedLoss":
    """The checks across keys, then the loss parameters (coerced in place: `eta: 3` -> 3.0),
    then the checks of the loss's chain part; returns the loss resolved. (A key of another
    draft type is refused by the schema: the draft section is its type's.)"""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.drafts import planned

    t, can = recipe.train, planned(recipe.draft).capabilities
    _first_failure(
        [
            (
                t.global_batch_size % t.micro_batch_size == 0,
                f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size ({t.micro_batch_size})",
            ),
            (
                t.threads is None or t.threads <= max_threads(),
                f"train.threads ({t.threads}) must be at most {max_threads()} (4 per core of "
                "this machine), or null: chosen",
            ),
            *_draft_checks(recipe, can),
            *_cache_checks(recipe),
            *_depth_checks(recipe),
            *_on_policy_checks(recipe, can),
            *_head_checks(recipe),
            *_prepare_checks(recipe),
        ]
    )
    loss = resolved_loss(recipe)
    _first_failure(_chain_checks(recipe, can, loss))
    return loss


def _first_failure(checks: list[Check]) -> None:
    for ok, message in checks:
        if not ok:
            raise RecipeError(message)


def _asks(can: "Capabilities", capability: str, asked: bool, generic: str) -> Check:
    """A recipe that asks (`asked`) for `capability` of a type with capabilities `can`: refused
    with the type's own message for it, else `generic`."""
    refusal = can.refusal(capability, generic)
    return not asked or refusal is None, refusal or ""


def _draft_checks(recipe: Recipe, can: "Capabilities") -> list[Check]:
    """What the recipe asks of its draft type."""
    d, kind = recipe.draft, f"draft.type={recipe.draft.type}"
    return [
        _asks(
            can,
            "fresh",
            d.model is None,
            "draft.model must name the draft (HF id, directory or embedded:<name>)",
        ),
        _asks(
            can, "lora", d.lora.r > 0, f"draft.lora is not supported for {kind}: set draft.lora.r=0"
        ),
        _asks(
            can,
            "chunked_loss",
            recipe.loss.chunk_size is not None,
            f"loss.chunk_size is not supported for {kind}: set loss.chunk_size=null",
        ),
        (
            recipe.prepare.top_n is None or recipe.target.cache is None or can.sparse_targets,
            f"prepare.top_n keeps the target's top N while answering, and target.cache is "
            f"then a top-N cache; draft.type={recipe.draft.type} trains on a cache over its "
            "own columns: unset prepare.top_n",
        ),
        *_cache_asks(recipe, can, _columns(recipe, can)),
    ]


def _columns(recipe: Recipe, can: "Capabilities") -> str | None:
    """The columns of the recipe's target cache ("top-n" or "draft"); None without one. A
    cache not built yet counts as what `specdistill prepare` would build for this draft type
    (`target_cache_vocab.columns_for`)."""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.train.target_cache_vocab import cache_columns, columns_for

    cache = recipe.target.cache
    if cache is None:
        return None
    return cache_columns(cache) or columns_for(can, recipe.prepare.top_n)


def _cache_asks(recipe: Recipe, can: "Capabilities", columns: str | None) -> list[Check]:
    """What a target cache of `columns` asks of the draft type."""
    kind = f"draft.type={recipe.draft.type}"
    return [
        _asks(
            can,
            "sparse_targets",
            columns == "top-n",
            f"target.cache gives a sparse top-N target, which {kind} does not train on: "
            "unset target.cache",
        ),
        _asks(
            can,
            "vocab_targets",
            columns == "draft",
            f"target.cache holds the target over a reduced draft vocabulary's columns, which "
            f"{kind} without draft.vocab_size does not have: build a top-N cache "
            "(`specdistill cache --columns top-n`) or unset target.cache",
        ),
    ]


def cache_checks(recipe: Recipe, columns: str) -> None:
    """Raise RecipeError when distill would refuse to train `recipe` on a cache of `columns`
    ("top-n" or "draft"): what `specdistill cache` checks before it loads anything."""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.drafts import planned

    can = planned(recipe.draft).capabilities
    probe = recipe.model_copy(
        update={"target": recipe.target.model_copy(update={"cache": "(the cache)"})}
    )
    _first_failure(
        [*_cache_asks(recipe, can, columns), *_cache_checks(probe), *_on_policy_checks(probe, can)]
    )
    _first_failure(_chain_checks(probe, can, resolved_loss(probe)))


def _cache_checks(recipe: Recipe) -> list[Check]:
    lo, cache = recipe.loss, recipe.target.cache
    head = recipe.acceptance_head
    return [
        (
            cache is None or lo.chunk_size is None,
            "target.cache gives a sparse top-N target, which needs no chunking: set "
            "loss.chunk_size=null",
        ),
        (
            cache is None
            or (
                lo.temperature == 1.0
                and lo.params.get("top_p") is None
                and lo.params.get("top_k") is None
            ),
            "target.cache holds the target's top-N at temperature 1 and the mass it drops, "
            "which the loss compares as a rest bin; that mass at another loss.temperature or "
            "under loss top_p / top_k is unknown: use loss.temperature=1 without top_p / top_k, "
            "or the live target",
        ),
        (
            cache is None or not head.enabled or recipe.eval.temperature == 1.0,
            f"acceptance_head labels α at eval.temperature ({recipe.eval.temperature}); "
            "target.cache holds the target at temperature 1 only: set eval.temperature=1, "
            "or train on the live target",
        ),
    ]


def _depth_checks(recipe: Recipe) -> list[Check]:
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.losses.resolved import end_to_end_losses

    lo, product_forms = recipe.loss, end_to_end_losses()
    return [
        (
            lo.depth_weighting != "end_to_end" or lo.name in product_forms,
            "loss.depth_weighting=end_to_end is the multi-depth TV loss; set "
            f"loss.name={' or '.join(product_forms)}",
        ),
        (
            lo.depth_decay is None or lo.depth_weighting == "geometric",
            "loss.depth_decay (> 0) applies to loss.depth_weighting=geometric only",
        ),
    ]


def _chain_checks(recipe: Recipe, can: "Capabilities", loss: "ResolvedLoss") -> list[Check]:
    """The loss's accepted-length part (tau: the draft's own chains), where it has one."""
    d, cache = recipe.draft, recipe.target.cache
    return [
        _asks(
            can,
            "accepted_length",
            loss.chain is not None,
            "loss tau (the draft's own chains) is implemented for standalone drafts and "
            f"EAGLE-3 heads; for draft.type={d.type} use a per-token loss (e.g. lk_lambda)",
        ),
        (
            loss.chain is None or cache is None,
            "loss tau scores the draft's own chains with the live target; target.cache only "
            "holds the target on the training text: unset target.cache",
        ),
    ]


def _on_policy_checks(recipe: Recipe, can: "Capabilities") -> list[Check]:
    o, d, t = recipe.data.on_policy, recipe.data, recipe.train
    on = o.fraction > 0
    return [
        (
            not on or recipe.loss.temperature != "traffic",
            "loss.temperature=traffic trains each traffic record at its own sampling; "
            "data.on_policy rows have no record: set data.on_policy.fraction=0 or give a "
            "temperature",
        ),
        (
            not on or int(o.fraction * t.global_batch_size + 0.5) >= 1,
            f"data.on_policy.fraction ({o.fraction}) × train.global_batch_size "
            f"({t.global_batch_size}) rounds to 0 generated sequences per step; raise it "
            f"to at least {0.5 / max(t.global_batch_size, 1):.3g}, or set it to 0",
        ),
        (
            not on or o.prompt_tokens is None or o.prompt_tokens < d.max_length,
            f"data.on_policy.prompt_tokens ({o.prompt_tokens}) must be below data.max_length "
            f"({d.max_length}): the rest of each sequence is generated",
        ),
        _asks(
            can,
            "writes_text",
            on and o.source == "draft",
            f"data.on_policy.source=draft needs a draft that writes a text alone, which "
            f"draft.type={recipe.draft.type} does not: use data.on_policy.source=target",
        ),
        (
            not on or recipe.target.cache is None,
            "data.on_policy generates sequences that target.cache does not hold: unset "
            "target.cache (the live target scores them) or set data.on_policy.fraction=0",
        ),
    ]


def _prepare_checks(recipe: Recipe) -> list[Check]:
    """Each prepared set has a directory, and the data it feeds reads that directory."""
    checks = []
    for name in ("train", "eval"):
        s, data = getattr(recipe.prepare, name), getattr(recipe.data, name) or []
        if s.prompts is None:
            continue
        out = s.out.rstrip("/") if s.out else None
        checks += [
            (out is not None, f"prepare.{name}.prompts is set: set prepare.{name}.out too"),
            (
                out is None or any(str(d).startswith(f"{out}/") for d in data),
                f"prepare.{name}.out ({out}) is not read by data.{name} ({data}): add "
                f"'{out}/regen-*.jsonl' to data.{name}",
            ),
        ]
    train, held_out = recipe.prepare.train.out, recipe.prepare.eval.out
    checks.append(
        (
            not (train and held_out) or os.path.realpath(train) != os.path.realpath(held_out),
            f"prepare.eval.out ({held_out}) is prepare.train.out ({train}): held-out answers "
            "would be trained on; give the held-out set its own directory",
        )
    )
    return checks


def _head_checks(recipe: Recipe) -> list[Check]:
    h, t, d = recipe.acceptance_head, recipe.train, recipe.draft
    only = t.only == "acceptance_head"
    return [
        (
            not only or h.enabled,
            "train.only=acceptance_head trains the acceptance head alone: set "
            "acceptance_head.enabled=true",
        ),
        (
            not only or d.lora.r == 0,
            "train.only=acceptance_head keeps the draft as loaded: unset draft.lora.r (0)",
        ),
        (
            not only or d.model is not None,
            "train.only=acceptance_head trains a head for a trained draft: draft.model must "
            "name it (e.g. runs/code-eagle3/final), not null (a fresh, untrained head)",
        ),
        (
            not h.enabled or recipe.target.cache is None or recipe.eval.temperature == 1.0,
            "acceptance_head.enabled: the head's label is α at eval.temperature "
            f"({recipe.eval.temperature}), but target.cache holds the target's top-N at "
            "temperature 1 only: set eval.temperature=1, or unset target.cache (the live "
            "target)",
        ),
        (
            not h.enabled or h.stop_gradient or recipe.loss.chunk_size is None,
            "acceptance_head.stop_gradient=false is not supported with loss.chunk_size (the "
            "chunked head loss reads the draft's hidden states detached): set "
            "acceptance_head.stop_gradient=true or loss.chunk_size=null",
        ),
        (
            not h.enabled or h.stop_gradient or t.mixed_precision != "fp16",
            "acceptance_head.stop_gradient=false with train.mixed_precision=fp16 is not "
            "supported (the head's gradients are not loss-scaled): use bf16 or no, or "
            "acceptance_head.stop_gradient=true",
        ),
    ]
