"""Recipes: YAML files mapped onto typed dataclasses, with `key.sub=value` overrides.

    recipe = load_recipe("recipes/code.yaml", ["train.max_steps=50", "loss.name=tv"])

Unknown keys and bad values raise `RecipeError` with a message that names the key and the fix.
"""

import dataclasses
import difflib
import functools
import operator
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from specdistill.errors import UserError


class RecipeError(UserError):
    """A recipe key is unknown or its value is invalid."""


# Enumerated values: `_coerce` checks them against these sets and names the allowed ones.
Dtype = Literal["float32", "bfloat16", "float16"]
DraftType = Literal["standalone", "eagle3"]  # the types of the drafts layer (drafts.TYPES)
DepthWeighting = Literal["geometric", "expected_length", "end_to_end"]
MixedPrecision = Literal["no", "bf16", "fp16"]
WandbMode = Literal["offline", "online", "disabled"]
OnPolicySource = Literal["draft", "target"]


@dataclass
class LoraConfig:
    r: int = 0  # 0 = full fine-tuning of the draft; > 0 wraps it in a peft LoRA adapter
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


@dataclass
class TargetConfig:
    model: str = "embedded:code-deep"  # HF id, local dir, or embedded:<name>
    dtype: Dtype = "float32"
    revision: str | None = None
    # A peft LoRA adapter directory on `model` (a fine-tuned target), loaded unmerged
    # (drafts.hub.load_target); null = the base model alone.
    adapter: str | None = None
    # A target cache directory (`specdistill cache`, train/target_cache.py): the loss reads the
    # target's cached top-N instead of running it (standalone drafts; null = live target).
    cache: str | None = None


@dataclass
class DraftConfig:
    type: DraftType = "standalone"  # standalone (a small causal LM) | eagle3 (a head on the target)
    # standalone: HF id, local dir or embedded:<name>. eagle3: null for a fresh head built on
    # the target, or an EAGLE-3 checkpoint directory to continue from.
    model: str | None = "embedded:code-deep-draft"
    dtype: Dtype = "float32"  # master weights; compute precision comes from train.mixed_precision
    revision: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    # eagle3 only:
    vocab_size: int | None = None  # V_d: most frequent loss-masked training tokens; null = V
    aux_layers: list[int] | None = None  # target layers whose input is fused; null = automatic
    ttt_steps: int = 3  # training-time-test depth K
    intermediate_size: int | None = None  # the head's MLP width; null = the target's
    norm_before_residual: bool = False  # as vLLM's flag; SGLang supports only false
    freeze_lm_head: bool = False  # keep lm_head at the target's rows of V_d (not trained)


@dataclass
class OnPolicyConfig:
    """Part of each batch generated on the fly (train/on_policy.py)."""

    fraction: float = 0.0  # share of each global batch's sequences generated (0 = off)
    # draft: the draft's own samples (DistillSpec / GKD); target: the target's, through the
    # speculative decoding engine with the current draft (eval/engine.py)
    source: OnPolicySource = "draft"
    prompt_tokens: int = 32  # the first tokens of the slot's training sequence: the prompt
    max_new_tokens: int | None = None  # null: up to data.max_length in all
    temperature: float = 1.0  # sampling temperature: the serving one (0 = greedy)
    gamma: int = 4  # source=target: draft tokens per speculative round


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=lambda: ["embedded:code"])
    eval: list[str] | None = None  # None: a held-out split of `train`
    max_length: int = 256
    pack: bool = True
    eval_fraction: float = 0.05
    skip_malformed: bool = False
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)


@dataclass
class LossConfig:
    name: str = "lk_lambda"
    temperature: float = 1.0  # both distributions are compared at this temperature
    chunk_size: int | None = None  # positions per chunk: never materialise [batch, seq, vocab]
    # Weighting of the K draft depths (eagle3 TTT): geometric | expected_length | end_to_end
    depth_weighting: DepthWeighting = "geometric"
    depth_decay: float | None = None  # geometric ratio (null = 0.8, EAGLE-3's)
    params: dict[str, Any] = field(default_factory=dict)  # loss-specific, e.g. {eta: 3.0}


@dataclass
class TrainConfig:
    max_steps: int = 200
    global_batch_size: int = 16  # sequences per optimiser step, over all processes
    micro_batch_size: int = 8  # sequences per forward on one process
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    max_grad_norm: float = 1.0
    mixed_precision: MixedPrecision = "no"
    seed: int = 0
    output_dir: str = "runs/code"
    save_every: int = 100  # 0 = only the final draft
    keep_checkpoints: int = 2
    resume: str = "no"  # no | auto | path to a checkpoint directory (YAML false reads as no)
    # true: delete the contents of a non-empty output_dir first. Otherwise a non-empty one is
    # refused unless resuming, so that two runs never mix their outputs.
    overwrite: bool = False
    log_every: int = 10


@dataclass
class SpeculativeEvalConfig:
    every: int = (
        0  # > 0: real speculative decoding on held-out prompts every N steps and at the end
    )
    gammas: list[int] = field(default_factory=lambda: [1, 2, 4])
    prompts: int = 4  # held-out sequences whose first `prompt_tokens` tokens are prompts
    prompt_tokens: int = 32
    max_new_tokens: int = 32


@dataclass
class EvalConfig:
    every: int = 100  # 0 = only before and after training
    temperature: float = 1.0
    max_sequences: int = 64  # held-out sequences per evaluation
    max_gamma: int = 8  # tau_pred is reported for gamma = 1..max_gamma
    # tau_pred replays rounds along the target's own continuations of tau_prompts held-out
    # prompts (their first tau_prompt_tokens tokens), tau_tokens each, generated once per run
    # (eval/offline.py); 0 prompts: tau_pred is the i.i.d. formula (also tau_pred_iid).
    tau_prompts: int = 8
    tau_prompt_tokens: int = 32
    tau_tokens: int = 64
    speculative: SpeculativeEvalConfig = field(default_factory=SpeculativeEvalConfig)


@dataclass
class WandbConfig:
    project: str | None = None  # None disables wandb
    mode: WandbMode = "offline"
    entity: str | None = None
    name: str | None = None


@dataclass
class OnlineConfig:
    """`specdistill online` (train/online/job.py): learn from the server's traffic log."""

    traffic: str | None = None  # the server's --traffic directory (shards traffic-NNNNNN.jsonl)
    drafts: str = "runs/online/drafts"  # the published root the server follows (--drafts)
    output_dir: str = "runs/online"  # OUT: state/, rejects.jsonl, decisions.jsonl, metrics.jsonl
    # A used output_dir that is not this job's own state (same target and drafts root) is
    # refused unless overwrite: true (its logs are then replaced).
    overwrite: bool = False
    # Train only on the records of these clients (the server's "client" field, "key-" + the
    # first 12 hex digits of sha256(api key)); empty or null: every client's records.
    clients: list[str] | None = None
    follow: bool = False  # true: tail new shards and appended lines; false: one pass, then exit
    # "specdistill": replay + held-out gate. "osd": OSD's policy (arXiv 2310.07177): update on
    # every refresh_records new records, no replay (buffer cleared), no hold-out, no gate,
    # promote always (use it with loss.name=fkl, the paper's forward KL).
    policy: Literal["specdistill", "osd"] = "specdistill"
    poll_s: float = 2.0
    refresh_records: int = 64  # a refresh after this many new trainable records ...
    refresh_seconds: float = 600.0  # ... or this many seconds (with >= min_refresh_records)
    min_refresh_records: int = 1
    refresh_steps: int = 20  # optimiser steps per refresh (more if the new records need them)
    max_refreshes: int = 0  # 0 = no limit
    recent_size: int = 512  # the bounded store of recent records
    reservoir_size: int = 512  # a uniform reservoir sample of the records older than that
    anchor: list[str] = field(default_factory=list)  # traffic dirs / .jsonl files: a fixed set
    recent_ratio: float = 0.7  # share of a refresh's sequences from the recent store
    anchor_ratio: float = 0.0  # share of the rest (the replay) taken from the anchor set
    holdout_size: int = 64  # the newest trainable records, held out for the gate
    min_holdout: int = 8  # fewer held-out sequences: no promotion
    max_record_tokens: int | None = None  # prompt + completion; null = data.max_length
    max_line_bytes: int = 4 * 1024 * 1024
    dedup_size: int = 100_000  # (prompt, completion) keys remembered: exact repeats dropped
    max_per_prompt: int = 4  # records of one prompt held at once (holdout, recent, reservoir)
    bootstrap_samples: int = 1000
    confidence: float = 0.95  # two-sided level of the paired bootstrap interval of Δα
    min_gain: float = 0.0  # promote only if the interval's lower bound is above this
    min_category_samples: int = 10
    max_regression: float = 0.05  # a category (>= min_category_samples) may drop this much
    keep_versions: int = 5
    watch_window: int = 50  # served records per rolling-α window
    watch_trailing: int = 5  # windows in the trailing level
    watch_drop: float = 0.1  # alert when a window's α is this far below the trailing level
    # Train on the records' top_logprobs (the target's raw top-k) as sparse targets with a rest
    # bin, skipping the target's forward, when every record of a refresh carries them and the
    # loss allows it (temperature 1, no top_p/top_k, no chunk_size, a standalone draft). Off by
    # default: on the embedded pair a top-20 target trains to a lower α than the live target
    # (docs/cache.md: the draft's mass off the top N drifts unsupervised).
    sparse_targets: bool = False


@dataclass
class Recipe:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)


_LOSS_FIELDS = {f.name for f in dataclasses.fields(LossConfig)} - {"params"}


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str) -> Any:
    """Check `value` against the annotation `tp`; convert where the meaning is unambiguous."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"{key} must be one of {', '.join(allowed)}, got {value!r}{hint}")
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except RecipeError:
                pass
        raise RecipeError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            value = [value]  # a single path is a one-element list
        if not isinstance(value, list):
            raise RecipeError(f"{key} must be a list, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{key} must be a mapping, got {value!r}")
        item = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        return {k: _coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise RecipeError(f"{key} must be a string, got {value!r}")
    if tp is Any:
        return value
    raise TypeError(f"unsupported recipe field type {tp} at {key}")


def _unknown_key(key: str, valid: list[str]) -> RecipeError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=1)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
    return RecipeError(f"unknown recipe key '{key}'; {hint}")


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"{prefix or 'recipe'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    if cls is LossConfig:  # loss parameters may be written flat: loss: {name: lk_lambda, eta: 3}
        raw = dict(raw)
        params = dict(raw.pop("params", None) or {})
        params.update({k: raw.pop(k) for k in list(raw) if k not in _LOSS_FIELDS})
        raw["params"] = params
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise _unknown_key(full, names)
        tp = hints[key]
        if full == "train.resume":
            value = _resume_value(value)
        kwargs[key] = (
            _build(tp, value, full) if _is_dataclass_type(tp) else _coerce(value, tp, full)
        )
    return cls(**kwargs)


RESUME_VALUES = "no (or false), auto, or the path of a checkpoint directory"


def _resume_value(value: Any) -> Any:
    """train.resume as written: YAML 1.1 reads `no` / `off` / `false` as the boolean false,
    which means `no`. True (`yes`, `on`, `true`) is refused: it does not say whether to
    continue the newest checkpoint (`auto`) or a given one."""
    if value is False:
        return "no"
    if value is True:
        raise RecipeError(
            f"train.resume must be {RESUME_VALUES}; got true (YAML reads yes / on / true as "
            "a boolean): write auto to continue from the newest checkpoint in train.output_dir"
        )
    if isinstance(value, str) and not value.strip():
        raise RecipeError(f"train.resume must be {RESUME_VALUES}; got an empty string")
    if not isinstance(value, str):
        raise RecipeError(f"train.resume must be {RESUME_VALUES}; got {value!r}")
    return value


def recipe_to_dict(recipe: Recipe) -> dict:
    """The recipe as plain data, loadable again: a standalone draft leaves out the EAGLE-3
    keys (setting them is an error there)."""
    d = dataclasses.asdict(recipe)
    if recipe.draft.type != "eagle3":
        for key in EAGLE3_KEYS:
            d["draft"].pop(key.removeprefix("draft."))
    d["loss"] = {**{k: v for k, v in d["loss"].items() if k != "params"}, **d["loss"]["params"]}
    return d


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"cannot set '{key}': '{part}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=50` -> ("train.max_steps", 50); the value is parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise RecipeError(
            f"override {text!r} must look like key.sub=value (e.g. train.max_steps=50)"
        )
    try:
        return key.strip(), yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise RecipeError(f"override {text!r}: value is not valid YAML ({e})") from None


def validate(recipe: Recipe, explicit: set[str] = frozenset()) -> None:
    """Value checks beyond types. Each message names the key and what to do.

    explicit: the dotted keys the recipe file and overrides set (not left at defaults)."""
    t, e, d, lo = recipe.train, recipe.eval, recipe.data, recipe.loss
    checks = [
        (t.max_steps >= 1, f"train.max_steps must be >= 1, got {t.max_steps}"),
        (t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}"),
        (
            t.global_batch_size >= 1,
            f"train.global_batch_size must be >= 1, got {t.global_batch_size}",
        ),
        (
            t.micro_batch_size < 1  # reported above; no modulo by zero
            or t.global_batch_size >= t.micro_batch_size
            and t.global_batch_size % t.micro_batch_size == 0,
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({t.micro_batch_size})",
        ),
        (t.lr > 0, f"train.lr must be > 0, got {t.lr}"),
        (t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}"),
        (t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}"),
        (0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}"),
        (t.max_grad_norm > 0, f"train.max_grad_norm must be > 0, got {t.max_grad_norm}"),
        (t.save_every >= 0, f"train.save_every must be >= 0 (0 = final only), got {t.save_every}"),
        (t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}"),
        (t.log_every >= 1, f"train.log_every must be >= 1, got {t.log_every}"),
        (e.every >= 0, f"eval.every must be >= 0 (0 = before/after only), got {e.every}"),
        (e.temperature >= 0, f"eval.temperature must be >= 0, got {e.temperature}"),
        (e.max_sequences >= 1, f"eval.max_sequences must be >= 1, got {e.max_sequences}"),
        (e.max_gamma >= 1, f"eval.max_gamma must be >= 1, got {e.max_gamma}"),
        (e.tau_prompts >= 0, f"eval.tau_prompts must be >= 0, got {e.tau_prompts}"),
        (
            e.tau_prompt_tokens >= 1,
            f"eval.tau_prompt_tokens must be >= 1, got {e.tau_prompt_tokens}",
        ),
        (e.tau_tokens >= 2, f"eval.tau_tokens must be >= 2, got {e.tau_tokens}"),
        (
            e.speculative.every >= 0,
            f"eval.speculative.every must be >= 0, got {e.speculative.every}",
        ),
        (
            len(e.speculative.gammas) >= 1 and min(e.speculative.gammas) >= 1,
            "eval.speculative.gammas must be a non-empty list of ints >= 1, "
            f"got {e.speculative.gammas}",
        ),
        (
            e.speculative.prompts >= 1,
            f"eval.speculative.prompts must be >= 1, got {e.speculative.prompts}",
        ),
        (
            e.speculative.prompt_tokens >= 1 and e.speculative.max_new_tokens >= 1,
            "eval.speculative.prompt_tokens and eval.speculative.max_new_tokens must be >= 1",
        ),
        (d.max_length >= 2, f"data.max_length must be >= 2, got {d.max_length}"),
        (len(d.train) >= 1, "data.train must name at least one source"),
        (0 < d.eval_fraction < 1, f"data.eval_fraction must be in (0, 1), got {d.eval_fraction}"),
        (lo.temperature > 0, f"loss.temperature must be > 0, got {lo.temperature}"),
        (
            lo.chunk_size is None or lo.chunk_size >= 1,
            f"loss.chunk_size must be >= 1 (or null for the direct loss), got {lo.chunk_size}",
        ),
        (recipe.draft.lora.r >= 0, f"draft.lora.r must be >= 0, got {recipe.draft.lora.r}"),
        *_draft_checks(recipe, explicit),
        *_on_policy_checks(recipe),
        *_online_checks(recipe.online),
    ]
    for ok, message in checks:
        if not ok:
            raise RecipeError(message)
    _validate_loss(lo)


def _on_policy_checks(recipe: Recipe) -> list[tuple[bool, str]]:
    o, d, t = recipe.data.on_policy, recipe.data, recipe.train
    on = o.fraction > 0
    return [
        (0 <= o.fraction <= 1, f"data.on_policy.fraction must be in [0, 1], got {o.fraction}"),
        (
            not on or int(o.fraction * t.global_batch_size + 0.5) >= 1,
            f"data.on_policy.fraction ({o.fraction}) × train.global_batch_size "
            f"({t.global_batch_size}) rounds to 0 generated sequences per step; raise it "
            f"to at least {0.5 / max(t.global_batch_size, 1):.3g}, or set it to 0",
        ),
        (o.prompt_tokens >= 1, f"data.on_policy.prompt_tokens must be >= 1, got {o.prompt_tokens}"),
        (
            not on or o.prompt_tokens < d.max_length,
            f"data.on_policy.prompt_tokens ({o.prompt_tokens}) must be below data.max_length "
            f"({d.max_length}): the rest of each sequence is generated",
        ),
        (
            o.max_new_tokens is None or o.max_new_tokens >= 1,
            f"data.on_policy.max_new_tokens must be >= 1 or null, got {o.max_new_tokens}",
        ),
        (o.temperature >= 0, f"data.on_policy.temperature must be >= 0, got {o.temperature}"),
        (o.gamma >= 1, f"data.on_policy.gamma must be >= 1, got {o.gamma}"),
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


def _online_checks(o: OnlineConfig) -> list[tuple[bool, str]]:
    return [
        (o.refresh_records >= 1, f"online.refresh_records must be >= 1, got {o.refresh_records}"),
        (o.refresh_steps >= 1, f"online.refresh_steps must be >= 1, got {o.refresh_steps}"),
        (o.min_refresh_records >= 1, "online.min_refresh_records must be >= 1"),
        (o.max_per_prompt >= 1, f"online.max_per_prompt must be >= 1, got {o.max_per_prompt}"),
        (
            o.recent_size >= 1 and o.reservoir_size >= 0,
            "online.recent_size must be >= 1 and online.reservoir_size >= 0",
        ),
        (0 < o.recent_ratio <= 1, f"online.recent_ratio must be in (0, 1], got {o.recent_ratio}"),
        (0 <= o.anchor_ratio <= 1, f"online.anchor_ratio must be in [0, 1], got {o.anchor_ratio}"),
        (
            o.holdout_size >= 1 and o.min_holdout >= 1,
            "online.holdout_size and online.min_holdout must be >= 1",
        ),
        (0 < o.confidence < 1, f"online.confidence must be in (0, 1), got {o.confidence}"),
        (o.bootstrap_samples >= 100, "online.bootstrap_samples must be >= 100"),
        (o.max_regression >= 0, f"online.max_regression must be >= 0, got {o.max_regression}"),
        (o.keep_versions >= 2, f"online.keep_versions must be >= 2, got {o.keep_versions}"),
        (
            o.watch_window >= 1 and o.watch_trailing >= 1,
            "online.watch_window and online.watch_trailing must be >= 1",
        ),
        (o.poll_s > 0, f"online.poll_s must be > 0, got {o.poll_s}"),
        *(
            (
                isinstance(c, str) and re.fullmatch(r"key-[0-9a-f]{12}", c) is not None,
                f'online.clients: {c!r} is not a client id like key-0123456789ab ("key-" + '
                "the first 12 hex digits of the sha256 of the client's API key, as the "
                "server's traffic records write it)",
            )
            for c in o.clients or ()
        ),
    ]


# Keys that configure an EAGLE-3 head; setting one on a standalone draft is a mistake.
EAGLE3_KEYS = {
    f"draft.{k}"
    for k in (
        "vocab_size",
        "aux_layers",
        "ttt_steps",
        "intermediate_size",
        "norm_before_residual",
        "freeze_lm_head",
    )
}


def _draft_checks(recipe: Recipe, explicit: set[str]) -> list[tuple[bool, str]]:
    d, lo = recipe.draft, recipe.loss
    eagle = d.type == "eagle3"
    return [
        (
            eagle or d.model is not None,
            "draft.model must name the draft (HF id, directory or embedded:<name>)",
        ),
        (d.ttt_steps >= 1, f"draft.ttt_steps must be >= 1, got {d.ttt_steps}"),
        (
            d.vocab_size is None or d.vocab_size >= 1,
            f"draft.vocab_size must be >= 1 or null, got {d.vocab_size}",
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
            not eagle or recipe.target.cache is None,
            "target.cache holds the target's top-N probabilities only; an eagle3 head also "
            "needs the target's hidden states at every position, so it trains on the live "
            "target: unset target.cache",
        ),
        (
            recipe.target.cache is None or lo.chunk_size is None,
            "target.cache gives a sparse top-N target, which needs no chunking: set "
            "loss.chunk_size=null",
        ),
        (
            recipe.target.cache is None
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
            eagle or not (explicit & EAGLE3_KEYS),
            f"{', '.join(sorted(explicit & EAGLE3_KEYS))} apply to draft.type=eagle3 only",
        ),
        (
            lo.depth_weighting != "end_to_end" or lo.name == "tv",
            "loss.depth_weighting=end_to_end is the multi-depth TV loss; set loss.name=tv",
        ),
        (
            lo.depth_decay is None or (lo.depth_weighting == "geometric" and lo.depth_decay > 0),
            "loss.depth_decay (> 0) applies to loss.depth_weighting=geometric only",
        ),
    ]


def _validate_loss(lo: LossConfig) -> None:
    """Check the loss name and the type of each parameter against the loss functions'
    signatures (coercing e.g. `eta: 3` to 3.0), then ask the loss library itself for the
    value checks: it knows each loss's ranges."""
    from specdistill import losses
    from specdistill.losses.divergences import check_param_values

    if lo.name not in losses.LOSSES:
        raise RecipeError(f"loss: unknown loss {lo.name!r}; {_hint(lo.name, list(losses.LOSSES))}")
    params = dict(lo.params)
    if lo.name == "mix" and "parts" in params:  # the parts decide which parameters exist
        params["parts"] = _coerce(params["parts"], dict[str, float], "loss.parts")
        names = sorted(set(losses.LOSSES) - {"mix"})
        for part in params["parts"]:
            if part not in names:
                raise RecipeError(f"loss: mix: unknown part {part!r}; {_hint(part, names)}")
    types_ = _loss_param_types(lo.name, params)
    for key, value in params.items():
        if key not in types_:
            valid = sorted(types_) or ["(none)"]
            close = difflib.get_close_matches(key, sorted(types_) + sorted(_LOSS_FIELDS), n=1)
            hint = f"did you mean 'loss.{close[0]}'? " if close else ""
            raise RecipeError(
                f"loss: {lo.name} takes no parameter 'loss.{key}'; {hint}"
                f"its parameters: {', '.join(valid)}"
            )
        params[key] = _coerce(value, types_[key], f"loss.{key}")
    lo.params = params
    try:  # the values each parameter may take, as the loss library declares them
        check_param_values(lo.name, lo.params)
    except ValueError as e:
        raise RecipeError(f"loss: {e}") from None


def _hint(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"valid: {', '.join(sorted(valid))}"


# compute_loss keywords that the trainer sets itself, not loss parameters
_NOT_LOSS_PARAMS = {"temperature", "d2t"}


def _loss_param_types(name: str, params: dict) -> dict[str, Any]:
    """Recipe type of every parameter loss `name` takes: the keyword-only parameters of the
    loss function (for mix, also of its parts) and of compute_loss (top_p, top_k, ...)."""
    import inspect

    from specdistill import losses

    functions = [losses.compute_loss, losses.LOSSES[name]]
    if name == "mix":
        functions += [losses.LOSSES[part] for part in params.get("parts") or {}]
    types_ = {}
    for function in functions:
        hints = typing.get_type_hints(function)
        for p in inspect.signature(function).parameters.values():
            if p.kind is not p.KEYWORD_ONLY or p.name in _NOT_LOSS_PARAMS:
                continue
            default_type = Any if p.default is p.empty or p.default is None else type(p.default)
            types_[p.name] = _recipe_type(hints.get(p.name, default_type))
    return types_


_RECIPE_TYPES = (bool, int, float, str, type(None))


def _recipe_type(tp):
    """`tp` with the parts a recipe cannot write (tensors) dropped; Any if nothing is left."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        kept = [arg for arg in typing.get_args(tp) if _recipe_type(arg) is not Any]
        return functools.reduce(operator.or_, kept) if kept else Any
    if tp in _RECIPE_TYPES or typing.get_origin(tp) in (list, dict):
        return tp
    return Any


def _recipe_path(path: Path) -> Path:
    """`path` itself, or a shipped recipe (specdistill.recipes) when `path` is a bare name
    such as `code` or `code.yaml` and no such file exists here."""
    if path.is_file():
        return path
    from importlib.resources import files

    shipped = Path(str(files("specdistill.recipes")))
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    if path.parent == Path(".") and (shipped / name).is_file():
        return shipped / name
    names = sorted(p.stem for p in shipped.glob("*.yaml"))
    raise RecipeError(f"recipe file not found: {path} (shipped recipes: {', '.join(names)})")


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe (or start from defaults when `path` is None) and apply overrides."""
    raw: dict = {}
    if path is not None:
        path = _recipe_path(Path(path))
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML ({e})") from None
        if raw is None:  # an empty file (or only comments): most likely not what was meant
            raise RecipeError(f"{path}: recipe is empty")
        if not isinstance(raw, dict):
            raise RecipeError(
                f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}"
            )
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
    recipe = _build(Recipe, raw, "")
    validate(recipe, set(_dotted_keys(raw)))
    return recipe


def _dotted_keys(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _dotted_keys(value, f"{prefix}{key}.")


def recipe_datasets(recipe: Recipe, tokenizer):
    """(train, eval) TokenDatasets of the recipe's `data` section, as the trainer sees them
    (the target cache must see the very same sequences)."""
    from specdistill.data import build_datasets

    d = recipe.data
    return build_datasets(
        tokenizer,
        d.train,
        d.eval,
        max_length=d.max_length,
        pack=d.pack,
        eval_fraction=d.eval_fraction,
        skip_malformed=d.skip_malformed,
        seed=recipe.train.seed,
    )


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
