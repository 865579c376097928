"""The recipe checks that relate several keys, and the loss parameters, whose names and
types depend on `loss.name` (read from the loss library, `losses.api.loss_params`).

Each key's own type and range is the schema's (train/recipe.py); what is here cannot be said
of one key alone. Every message names the keys and what to do.
"""

import functools
import operator
import types
import typing
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from specdistill.train.recipe import EAGLE3_KEYS, LossConfig, Recipe, Section
from specdistill.train.recipe_errors import RecipeError, did_you_mean, translate
from specdistill.train.recipe_types import Float

Check = tuple[bool, str]


def explicit_keys(section: Section, prefix: str = "") -> set[str]:
    """The dotted keys that were given (by the recipe file or an override), not defaulted."""
    keys = set()
    for name in section.model_fields_set:
        value = getattr(section, name)
        keys.add(f"{prefix}{name}")
        if isinstance(value, Section):
            keys |= explicit_keys(value, f"{prefix}{name}.")
    return keys


def validate(recipe: Recipe, explicit: set[str] | None = None) -> None:
    """The checks across keys, then the loss parameters (coerced in place: `eta: 3` -> 3.0).

    explicit: the dotted keys the recipe file and overrides set (default: the ones the
    recipe's sections were given)."""
    if explicit is None:
        explicit = explicit_keys(recipe)
    t = recipe.train
    checks = [
        (
            t.global_batch_size % t.micro_batch_size == 0,
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({t.micro_batch_size})",
        ),
        *_draft_checks(recipe, explicit),
        *_on_policy_checks(recipe),
        *_head_checks(recipe),
        *_prepare_checks(recipe),
    ]
    for ok, message in checks:
        if not ok:
            raise RecipeError(message)
    validate_loss(recipe.loss)


def _draft_checks(recipe: Recipe, explicit: set[str]) -> list[Check]:
    d, lo, cache = recipe.draft, recipe.loss, recipe.target.cache
    eagle = d.type == "eagle3"
    return [
        (
            eagle or d.model is not None,
            "draft.model must name the draft (HF id, directory or embedded:<name>)",
        ),
        (
            not eagle or d.lora.r == 0,
            "draft.lora applies to a standalone draft; an eagle3 head is trained in full",
        ),
        (
            not eagle or lo.chunk_size is None,
            "loss.chunk_size is not supported for draft.type=eagle3 (its V_d logits are small); "
            "set loss.chunk_size=null",
        ),
        (
            d.type != "parallel" or lo.chunk_size is None,
            "loss.chunk_size is not supported for draft.type=parallel (its depths come from "
            "one forward over the block's copies): set loss.chunk_size=null",
        ),
        (
            not eagle or cache is None,
            "target.cache holds the target's top-N probabilities only; an eagle3 head also "
            "needs the target's hidden states at every position, so it trains on the live "
            "target: unset target.cache",
        ),
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
            d.type != "parallel" or cache is None,
            "target.cache holds the target's top-N at each position for a standalone draft; a "
            "parallel draft's depths compare the target at shifted positions: unset target.cache",
        ),
        (
            d.vocab_size is None or d.type != "standalone" or lo.chunk_size is None,
            "loss.chunk_size is not supported with draft.vocab_size (the draft's V_d logits "
            "are small): set loss.chunk_size=null",
        ),
        (
            d.vocab_size is None or d.type != "standalone" or cache is None,
            "target.cache gives a sparse top-N target with a rest bin, which a reduced output "
            "vocabulary (draft.vocab_size) cannot be compared with: unset target.cache",
        ),
        (
            eagle or not (explicit & EAGLE3_KEYS),
            f"{', '.join(sorted(explicit & EAGLE3_KEYS))} apply to draft.type=eagle3 only",
        ),
        (
            not _uses_tau(lo) or d.type in ("standalone", "eagle3"),
            "loss tau (the draft's own chains) is implemented for standalone drafts and "
            f"EAGLE-3 heads; for draft.type={d.type} use a per-token loss (e.g. lk_lambda)",
        ),
        (
            not _uses_tau(lo) or cache is None,
            "loss tau scores the draft's own chains with the live target; target.cache only "
            "holds the target on the training text: unset target.cache",
        ),
        (
            lo.depth_weighting != "end_to_end" or lo.name == "tv",
            "loss.depth_weighting=end_to_end is the multi-depth TV loss; set loss.name=tv",
        ),
        (
            lo.depth_decay is None or lo.depth_weighting == "geometric",
            "loss.depth_decay (> 0) applies to loss.depth_weighting=geometric only",
        ),
    ]


def _uses_tau(lo) -> bool:
    """Whether the loss has an accepted-length part (loss.name tau, or a tau part of mix)."""
    parts = lo.params.get("parts")
    return lo.name == "tau" or (lo.name == "mix" and isinstance(parts, dict) and "tau" in parts)


def _on_policy_checks(recipe: Recipe) -> list[Check]:
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
            not on or o.prompt_tokens < d.max_length,
            f"data.on_policy.prompt_tokens ({o.prompt_tokens}) must be below data.max_length "
            f"({d.max_length}): the rest of each sequence is generated",
        ),
        (
            not on or o.source != "draft" or recipe.draft.type != "eagle3",
            "data.on_policy.source=draft needs a standalone draft: an eagle3 head drafts from "
            "the target's features and cannot write a text alone; use "
            "data.on_policy.source=target (speculative decoding with the head)",
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


def validate_loss(lo: LossConfig) -> None:
    """Check the loss name and the type of each parameter against the loss library's
    declaration (coercing e.g. `eta: 3` to 3.0), then ask the library for the value checks:
    it knows each loss's ranges."""
    from specdistill.losses.api import loss_params
    from specdistill.losses.divergences import NAMES, check_param_values

    if lo.name not in NAMES:
        hint = _hint(lo.name, list(NAMES))
        raise RecipeError(f"loss: unknown loss {lo.name!r}; {hint}", key="loss.name")
    params = dict(lo.params)
    parts: dict = {}
    if lo.name == "mix" and "parts" in params:  # the parts decide which parameters exist
        params["parts"] = parts = _coerce(params["parts"], dict[str, float], "loss.parts")
        names = sorted(set(NAMES) - {"mix"})
        for part in parts:
            if part not in names:
                raise RecipeError(
                    f"loss: mix: unknown part {part!r}; {_hint(part, names)}", key="loss.parts"
                )
    declared = loss_params(lo.name, parts)
    own_keys = sorted(set(LossConfig.model_fields) - {"params"})
    for key, value in params.items():
        if key not in declared:
            valid = sorted(declared) or ["(none)"]
            close = did_you_mean(key, sorted(declared) + own_keys)
            hint = f"did you mean 'loss.{close}'? " if close else ""
            raise RecipeError(
                f"loss: {lo.name} takes no parameter 'loss.{key}'; {hint}"
                f"its parameters: {', '.join(valid)}",
                key=f"loss.{key}",
            )
        params[key] = _coerce(value, declared[key].type, f"loss.{key}")
    lo.params = params
    try:  # the values each parameter may take, as the loss library declares them
        check_param_values(lo.name, lo.params)
    except ValueError as e:
        raise RecipeError(f"loss: {e}") from None


def _hint(name: str, valid: list[str]) -> str:
    close = did_you_mean(name, valid)
    return (f"did you mean {close!r}? " if close else "") + f"valid: {', '.join(sorted(valid))}"


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """`value` validated as a recipe value of `annotation` (strict, numbers from YAML)."""
    tp = recipe_type(annotation)
    try:
        return _adapter(tp).validate_python(value)
    except ValidationError as e:
        raise translate(e, tp, key) from None


@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp, config=ConfigDict(strict=True))


_RECIPE_TYPES = (bool, int, str, type(None))


def recipe_type(tp: Any) -> Any:
    """The annotation of a loss parameter as a recipe reads it: the parts a recipe cannot
    write (tensors) dropped, float as the recipe's number (Any if nothing is left)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        kept = [recipe_type(arg) for arg in typing.get_args(tp)]
        kept = [arg for arg in kept if arg is not Any]
        return functools.reduce(operator.or_, kept) if kept else Any
    if tp is float:
        return Float
    if origin is list:
        (item,) = typing.get_args(tp)
        return list[recipe_type(item)]
    if origin is dict:
        key, item = typing.get_args(tp)
        return dict[key, recipe_type(item)]
    return tp if tp in _RECIPE_TYPES else Any
