"""The recipe schema: one pydantic model per section, the single source of every key's type,
default, allowed values or range, description, and whether it may change when a run resumes.
The draft section is one model per draft type, picked by `draft.type` (train/recipe_draft.py).

Loading a YAML file and the `key.sub=value` overrides is train/config.py; the checks that
relate several keys are train/recipe_checks.py (what the recipe asks of its draft type,
against the type's declared capabilities), the loss parameters and the loss resolved for the
step train/recipe_loss.py; the reference of all keys in docs/ is generated from these models
by train/recipe_docs.py.
"""

from typing import Any

from pydantic import model_validator

from specdistill.bounds import MAX_BATCH, MAX_CONTEXT
from specdistill.train.recipe_draft import DraftConfig, StandaloneDraft
from specdistill.train.recipe_online import OnlineConfig
from specdistill.train.recipe_types import (
    RESUME,
    AnswerEngineName,
    DepthWeighting,
    Dtype,
    Float,
    LossName,
    LossTemperature,
    MixedPrecision,
    OnPolicySource,
    PositiveInts,
    Resume,
    Section,
    Strings,
    TrainOnly,
    WandbMode,
    recipe_key,
    sections_of,
)


class TargetConfig(Section):
    model: str = recipe_key(
        "embedded:code-deep", "HF id, local directory, embedded:<name> or registry:<name>"
    )
    dtype: Dtype = recipe_key("float32", "the target's weights dtype")
    revision: str | None = recipe_key(None, "HF revision (branch, tag or commit) of target.model")
    adapter: str | None = recipe_key(
        None,
        "a peft LoRA adapter directory on target.model (a fine-tuned target), loaded "
        "unmerged; null: the base model alone",
    )
    cache: str | None = recipe_key(
        None,
        "a target cache directory, written by specdistill prepare (after the answers) or "
        "specdistill cache: the loss reads the target's stored log-probabilities (its top-N, "
        "or a reduced draft vocabulary's columns) instead of running it (standalone drafts); "
        "null: the live target",
    )


class OnPolicyConfig(Section):
    """Part of each batch generated on the fly (train/on_policy.py)."""

    fraction: Float = recipe_key(
        0.0,
        "share of each global batch's sequences generated on the fly (0: off); only the "
        "generated tokens are trained on",
        ge=0,
        le=1,
    )
    source: OnPolicySource = recipe_key(
        "draft",
        "draft: the draft's own samples (DistillSpec / GKD); target: the target's, "
        "through speculative decoding with the current draft",
    )
    prompt_tokens: int | None = recipe_key(
        32,
        "the first tokens of the slot's training sequence: the prompt; null: every token "
        "before its first trained one (a chat record's prompt, up to the assistant's reply)",
        ge=1,
    )
    max_new_tokens: int | None = recipe_key(
        None,
        "new tokens per sequence (each stops after EOS); null: up to data.max_length in all",
        ge=1,
    )
    temperature: Float = recipe_key(
        1.0, "sampling temperature: set it to the serving one (0: greedy)", ge=0
    )
    gamma: int = recipe_key(4, "source=target: draft tokens per speculative round", ge=1)


class DataConfig(Section):
    train: Strings = recipe_key(
        description="files, globs, directories, org/name[:split] HF datasets or embedded:<name>",
        factory=lambda: ["embedded:code"],
        min_length=1,
    )
    eval: Strings | None = recipe_key(
        None, "same forms; null: a held-out split of data.train (data.eval_fraction)"
    )
    max_length: int = recipe_key(
        256,
        "sequence length in tokens, at most the target's context (max_position_embeddings)",
        ge=2,
        le=MAX_CONTEXT,
    )
    pack: bool = recipe_key(True, "true: pack text into full blocks; false: truncate each record")
    eval_fraction: Float = recipe_key(
        0.05, "the held-out share of data.train when data.eval is null", gt=0, lt=1
    )
    skip_malformed: bool = recipe_key(
        False, "skip (and count) malformed records instead of stopping at the first"
    )
    on_policy: OnPolicyConfig = recipe_key(
        description="Sequences generated on the fly during training (train/on_policy.py).",
        factory=OnPolicyConfig,
    )


class LossConfig(Section):
    name: LossName = recipe_key(
        "lk_lambda",
        "the objective: a loss of the loss library (the section of losses below)",
    )
    temperature: LossTemperature = recipe_key(
        1.0,
        "both distributions are compared at this temperature (> 0); or the served "
        "temperatures {temperature: weight} (weights sum to 1; 0: greedy, trained at "
        "temperature 1), each weighted in the loss and in the held-out α / tau_pred "
        "(eval.json's mixture); or traffic (the online job: each record at its own "
        "temperature and top-p)",
    )
    chunk_size: int | None = recipe_key(
        None,
        "positions per chunk: a memory-bounded loss from hidden states that never "
        "materialises [batch, seq, vocab]; null: the direct loss",
        ge=1,
    )
    depth_weighting: DepthWeighting = recipe_key(
        "geometric",
        "weighting of the K draft depths of an EAGLE-3 head's training-time test "
        "(end_to_end: the multi-depth TV loss, loss.name=tv)",
    )
    depth_decay: Float | None = recipe_key(
        None, "the geometric ratio of depth_weighting=geometric; null: 0.8, EAGLE-3's", gt=0
    )
    params: dict[str, Any] = recipe_key(
        description="the loss's own parameters, e.g. {eta: 3.0}; also written flat "
        "(loss.eta=3.0). The section of loss parameters below lists them",
        factory=dict,
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_params(cls, raw: Any) -> Any:
        """loss: {name: lk_lambda, eta: 3} is loss: {name: lk_lambda, params: {eta: 3}}."""
        if not isinstance(raw, dict) or not isinstance(raw.get("params") or {}, dict):
            return raw
        raw = dict(raw)
        params = dict(raw.pop("params", None) or {})
        params.update({k: raw.pop(k) for k in list(raw) if k not in cls.model_fields})
        return {**raw, "params": params}


class TrainConfig(Section):
    max_steps: int = recipe_key(
        200, "optimiser steps; a resumed run may raise it", resume="grow", ge=1
    )
    global_batch_size: int = recipe_key(
        16,
        "sequences per optimiser step, over all processes (a multiple of "
        "train.micro_batch_size; the accumulation is derived)",
        ge=1,
        le=MAX_BATCH,
    )
    micro_batch_size: int = recipe_key(
        8, "sequences per forward on one process", ge=1, le=MAX_BATCH
    )
    lr: Float = recipe_key(1e-3, "AdamW's peak learning rate", gt=0)
    weight_decay: Float = recipe_key(0.0, "AdamW's weight decay", ge=0)
    warmup_steps: int = recipe_key(20, "linear warmup steps, then cosine decay", ge=0)
    min_lr_ratio: Float = recipe_key(0.1, "the cosine decay ends at lr × min_lr_ratio", ge=0, le=1)
    max_grad_norm: Float = recipe_key(1.0, "gradient clipping norm", gt=0)
    mixed_precision: MixedPrecision = recipe_key("no", "bf16 / fp16 through accelerate")
    seed: int = recipe_key(
        0, "seed of the data order, the held-out split and the initialisation", ge=0, le=2**32 - 1
    )
    output_dir: str = recipe_key("runs/code", "where everything is written", resume="harmless")
    save_every: int = recipe_key(
        100, "checkpoint period in steps (0: the final draft only)", resume="harmless", ge=0
    )
    keep_checkpoints: int = recipe_key(2, "checkpoints kept", resume="harmless", ge=1)
    resume: Resume = recipe_key(
        "no",
        "no (YAML false reads as no); auto: continue from the newest checkpoint in "
        "output_dir (a finished run is reported, not retrained); or a checkpoint path. The "
        "checkpoint's recipe must not differ in a key that changes the trained draft",
        resume="harmless",
    )
    overwrite: bool = recipe_key(
        False,
        "true: delete the contents of a non-empty output_dir first; otherwise a "
        "non-empty one is refused unless resuming, so that two runs never mix their outputs",
        resume="harmless",
    )
    log_every: int = recipe_key(10, "steps between progress lines", resume="harmless", ge=1)
    threads: int | None = recipe_key(
        None,
        "torch intra-op CPU threads per process; null: the cores free at the start, "
        "re-checked between steps (specdistill/threads.py); at most 4 per core",
        resume="harmless",
        ge=1,
    )
    only: TrainOnly | None = recipe_key(
        None,
        "null: train the draft (and its acceptance head when acceptance_head.enabled); "
        "acceptance_head: train the head alone on the frozen draft.model (a draft trained "
        "before, e.g. runs/code/final), which is saved unchanged with the head",
    )


class SpeculativeEvalConfig(Section):
    every: int = recipe_key(
        0,
        "> 0: real speculative decoding on held-out prompts every N steps and at the end; "
        "logs measured τ, speedup and best γ (spec/*)",
        ge=0,
    )
    gammas: PositiveInts = recipe_key(
        description="draft lengths γ tried", factory=lambda: [1, 2, 4], min_length=1
    )
    prompts: int = recipe_key(
        4, "held-out sequences whose first prompt_tokens tokens are prompts", ge=1
    )
    prompt_tokens: int = recipe_key(32, "prompt length in tokens", ge=1)
    max_new_tokens: int = recipe_key(32, "tokens generated per prompt", ge=1)


class EvalConfig(Section):
    every: int = recipe_key(
        100, "held-out α every N steps (0: only before and after training)", ge=0
    )
    temperature: Float = recipe_key(
        1.0, "temperature of the held-out α (0: greedy agreement)", ge=0
    )
    max_sequences: int = recipe_key(64, "held-out sequences per evaluation", ge=1)
    max_gamma: int = recipe_key(8, "tau_pred is reported for γ = 1..max_gamma", ge=1)
    tau_prompts: int = recipe_key(
        8,
        "tau_pred replays rounds along the target's own continuations (greedy at T = 0, "
        "sampled at eval.temperature) of this many held-out prompts, generated once per run "
        "(tau_texts.json); 0: tau_pred is the i.i.d. formula (also tau_pred_iid)",
        ge=0,
    )
    tau_prompt_tokens: int = recipe_key(32, "prompt length of those prompts in tokens", ge=1)
    tau_tokens: int = recipe_key(64, "tokens of each continuation", ge=2)
    prompts: str | None = recipe_key(
        None,
        "prompts from outside the training data: a prompt file (.jsonl, .json, .txt, or .gz "
        "of one, as `specdistill speculate --prompts` reads; e.g. "
        "benchmarks/prompts/HumanEval.jsonl.gz) or a traffic directory; each evaluation also "
        "reports tau_pred_chain, the draft's own chains scored by the target along its "
        "continuations of them (eval.tau_tokens each at eval.temperature, generated once per "
        "run: prompt_texts.json); null: none",
    )
    prompts_limit: int = recipe_key(8, "the first N prompts of eval.prompts", ge=1)
    prompts_max_tokens: int = recipe_key(
        256,
        "each eval.prompts prompt is cut to its last N tokens: at most the target's context "
        "(max_position_embeddings); the default is cut to that context when it is shorter",
        ge=1,
        le=MAX_CONTEXT,
    )
    speculative: SpeculativeEvalConfig = recipe_key(
        description="Real speculative decoding on held-out prompts during training.",
        factory=SpeculativeEvalConfig,
    )


class AcceptanceHeadConfig(Section):
    """The acceptance head (drafts/acceptance_head.py), trained with the draft."""

    enabled: bool = recipe_key(
        False,
        "train a head that predicts, per draft position, the target's acceptance of the "
        "draft's token (label: α at eval.temperature, the serving temperature); saved beside "
        "the draft, read by the engine's gamma=auto. false: no head trains; one saved with "
        "draft.model is kept as it is",
    )
    weight: Float = recipe_key(1.0, "weight of the head's loss term in the step's loss", gt=0)
    inner_size: int | None = recipe_key(
        None, "the head's hidden width; null: min(the draft's hidden size, 256)", ge=1
    )
    stop_gradient: bool = recipe_key(
        True,
        "true: the head reads the draft's hidden states detached, so the draft trains exactly "
        "as without the head; false: the head's loss also trains the draft",
    )
    lr: Float | None = recipe_key(None, "the head's peak learning rate; null: train.lr", gt=0)


class WandbConfig(Section):
    project: str | None = recipe_key(None, "wandb project; null: wandb is off")
    mode: WandbMode = recipe_key("offline", "offline unless you say online")
    entity: str | None = recipe_key(None, "wandb entity")
    name: str | None = recipe_key(None, "run name")


class PrepareSetConfig(Section):
    """Prompts the target answers into a directory (`specdistill prepare`)."""

    prompts: Strings | None = recipe_key(
        None, "the prompts: data.train's forms (chat or text records); null: none to answer"
    )
    out: str | None = recipe_key(
        None, "the directory the answers go to; data.train / data.eval read OUT/regen-*.jsonl"
    )
    limit: int | None = recipe_key(None, "answer the first N distinct prompts only", ge=1)


class PrepareVllmConfig(Section):
    """How vLLM answers when `prepare.engine` is vllm (eval/vllm_engine.py)."""

    dtype: Dtype | None = recipe_key(
        None,
        "the weights' dtype vLLM answers in; null: target.dtype (bfloat16 answers are a "
        "slightly different distribution from the float32 target that training reads)",
    )
    compile: bool = recipe_key(
        False,
        "let vLLM compile the model first: about 100 s more at the start on 2 CPU cores, "
        'then faster decoding (benchmarks/RESULTS.md, "Answering with vLLM")',
    )
    kv_cache_gib: Float = recipe_key(4.0, "vLLM's KV-cache memory on a CPU, in GiB", gt=0)
    max_num_seqs: int | None = recipe_key(
        None, "most answers vLLM decodes together; null: prepare's --batch-size", ge=1
    )


class PrepareConfig(Section):
    """`specdistill prepare`: the target resolved (fetched and converted once when it is a
    registry model), then the target's own answers to these prompts written as training and
    held-out data (train/prepare.py)."""

    train: PrepareSetConfig = recipe_key(
        description="The training answers.", factory=PrepareSetConfig
    )
    eval: PrepareSetConfig = recipe_key(
        description="The held-out answers.", factory=PrepareSetConfig
    )
    temperature: Float = recipe_key(0.7, "the target's sampling temperature (0: greedy)", ge=0)
    max_new_tokens: int = recipe_key(256, "tokens per answer", ge=1)
    seed: int = recipe_key(0, "sampling seed")
    top_n: int | None = recipe_key(
        None,
        "keep the target's top N log-probabilities at every training answer token while "
        "answering; target.cache is then a top-N cache built from them, with a target "
        "forward only for the sequences they do not serve (docs/cache.md); null: target.cache "
        "is a separate target pass after answering, over the draft's own columns for a "
        "reduced vocabulary",
        ge=1,
    )
    engine: AnswerEngineName = recipe_key(
        "specdistill",
        "what answers: specdistill (the project's engine), vllm (vLLM's offline engine, "
        "installed apart: docs/real-model.md) or auto (vllm where it is installed, else "
        "specdistill); the answers, the kept top N and everything downstream are the same "
        "files",
    )
    vllm: PrepareVllmConfig = recipe_key(
        description="vLLM's settings when prepare.engine is vllm.", factory=PrepareVllmConfig
    )


class Recipe(Section):
    target: TargetConfig = recipe_key(
        description="The model the draft learns from.", factory=TargetConfig
    )
    draft: DraftConfig = recipe_key(
        description="The model trained: a standalone draft, an EAGLE-3 head or a parallel "
        "draft. `draft.type` picks the section: the keys every type takes, and the type's own "
        "(train/recipe_draft.py).",
        factory=StandaloneDraft,
    )
    data: DataConfig = recipe_key(
        description="Training and held-out text (text files, JSONL with text, chat JSONL).",
        factory=DataConfig,
    )
    loss: LossConfig = recipe_key(
        description="The objective (docs/theory.md §3).", factory=LossConfig
    )
    train: TrainConfig = recipe_key(
        description="Optimisation and the run directory.", factory=TrainConfig
    )
    eval: EvalConfig = recipe_key(
        description="Held-out evaluation during training.", factory=EvalConfig, resume="harmless"
    )
    acceptance_head: AcceptanceHeadConfig = recipe_key(
        description="A head predicting the target's acceptance of each draft token "
        "(drafts/acceptance_head.py), for per-row draft lengths (gamma=auto).",
        factory=AcceptanceHeadConfig,
    )
    wandb: WandbConfig = recipe_key(
        description="Weights & Biases logging.", factory=WandbConfig, resume="harmless"
    )
    prepare: PrepareConfig = recipe_key(
        description="`specdistill prepare`: the target's answers made once as data.train / "
        "data.eval (train/prepare.py); `distill` ignores it.",
        factory=PrepareConfig,
        resume="harmless",
    )
    online: OnlineConfig = recipe_key(
        description="`specdistill online`: learn from the server's traffic log "
        "(docs/online.md); `distill` ignores it.",
        factory=OnlineConfig,
        resume="harmless",
    )


def leaf_keys(model: type[Section] = Recipe, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of `model` and its FieldInfo, sections expanded (the draft section's
    every type's keys), in schema order."""
    keys = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sections = sections_of(field.annotation)
        for section in sections:
            keys.update({k: v for k, v in leaf_keys(section, f"{key}.").items() if k not in keys})
        if not sections:
            keys[key] = field
    return keys


def _section_marks(model: type[Section] = Recipe, prefix: str = "") -> dict[str, dict]:
    """Dotted key -> its own marks merged over its sections' (a harmless section's keys are
    harmless)."""
    marks = {}
    for name, field in model.model_fields.items():
        key, own = f"{prefix}{name}", dict(field.json_schema_extra or {})
        sections = sections_of(field.annotation)
        for section in sections:
            for sub, sub_marks in _section_marks(section, f"{key}.").items():
                marks[sub] = {**own, **sub_marks}
        if not sections:
            marks[key] = own
    return marks


def keys_marked(name: str, value: Any = True) -> set[str]:
    return {key for key, marks in _section_marks().items() if marks.get(name) == value}


def harmless_keys() -> set[str]:
    """The keys a resumed run may change: they do not change the trained draft."""
    return keys_marked(RESUME, "harmless")
