"""The recipe's `draft` section: a union keyed by `draft.type`. The keys every type takes are
the common section's (`DraftSection`: type, model, dtype, revision, lora, vocab_size); each
type with keys of its own declares them in its subclass, and only those (`Eagle3Draft`: the
EAGLE-3 head's; `ParallelDraft`: parallel_depths; `StandaloneDraft`: none).

    draft:
      type: eagle3        # picks the section: Eagle3Draft
      model: null
      ttt_steps: 3

A key of another type is refused in one line naming it, this draft's type and the type that
has it (`draft.ttt_steps apply to draft.type=eagle3 only, not draft.type=standalone`); an
unknown type in one line listing the types. A type registered in the drafts layer without a
section here (a test's stand-in) takes the common keys only.

The sections live here, in the schema's layer, not beside each type in drafts/<type>/: they
are built from the schema's pydantic helpers (train/recipe_types.py), which the drafts layer
may not import; the drafts layer reads the section it is given by attribute only.
"""

from typing import Annotated, Any, ClassVar, Union

from pydantic import Discriminator, Tag, TypeAdapter, ValidationError, model_validator

from specdistill.train.recipe_errors import RecipeError, literal_message, translate
from specdistill.train.recipe_types import (
    DraftType,
    Dtype,
    Float,
    Ints,
    Section,
    Strings,
    draft_types,
    recipe_key,
)

DEFAULT_TYPE = "standalone"
OTHER = "registered"  # the union's tag of a registered type without a section of its own


class LoraConfig(Section):
    r: int = recipe_key(
        0,
        "0: full fine-tuning of the draft; > 0: train a peft LoRA adapter of this "
        "rank instead, merged into final/",
        ge=0,
    )
    alpha: int = recipe_key(16, "LoRA alpha (scale alpha / r)")
    dropout: Float = recipe_key(0.0, "LoRA dropout")
    target_modules: Strings = recipe_key(
        description="the draft's modules that get an adapter",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
    )


class DraftSection(Section):
    """The keys of every draft type; a subclass adds one type's own keys."""

    own_type: ClassVar[str | None] = None  # the draft.type whose section this is

    type: DraftType = recipe_key(
        DEFAULT_TYPE,
        "standalone: a small causal LM; eagle3: a head on the target's features; parallel: a "
        "causal LM with a mask token that drafts a block in one forward (docs/parallel.md). "
        "It picks the section: the keys below, and the type's own",
    )
    model: str | None = recipe_key(
        "embedded:code-deep-draft",
        "standalone: HF id, local directory or embedded:<name>; or target-layers:N (the "
        "target's first N layers: an early exit) or "
        "target-layers:0,15,29 (those layers): a draft made of the target's own layers, "
        "embeddings, final norm and output head (drafts/draft_init.py). "
        "eagle3: null for a fresh head built on the target, or an EAGLE-3 checkpoint directory "
        "to continue from",
    )
    dtype: Dtype = recipe_key(
        "float32", "master weights; the compute precision comes from train.mixed_precision"
    )
    revision: str | None = recipe_key(None, "HF revision (branch, tag or commit) of draft.model")
    lora: LoraConfig = recipe_key(
        description="A LoRA adapter instead of full fine-tuning (standalone drafts).",
        factory=LoraConfig,
    )
    vocab_size: int | None = recipe_key(
        None,
        "V_d: the draft's output vocabulary, the most frequent loss-masked training tokens; "
        "eagle3: the head's; standalone and parallel: the draft's output head keeps only "
        "those rows (FR-Spec; q = 0 outside V_d; a standalone one reaches vLLM and SGLang "
        "over the whole vocabulary, a parallel one exports as hf only). null: the target's V "
        "(or the V_d a reduced draft.model was saved with)",
        ge=1,
    )

    @model_validator(mode="before")
    @classmethod
    def _its_type_and_its_keys(cls, raw: Any) -> Any:
        """An unknown type, and the keys of another type, refused in one line each."""
        if not isinstance(raw, dict):
            return raw
        if cls.own_type is not None and "type" not in raw:  # built in code: its own type
            raw = {"type": cls.own_type, **raw}
        kind = raw.get("type", DEFAULT_TYPE)
        allowed = draft_types()
        if kind not in allowed:
            raise RecipeError(literal_message("draft.type", kind, allowed), key="draft.type")
        if cls.own_type is not None and kind != cls.own_type:
            raise RecipeError(f"draft.type={kind} given to the draft.type={cls.own_type} section")
        foreign: dict[str, list[str]] = {}
        for name in raw:
            owner = owner_of(name)
            if name not in cls.model_fields and owner is not None:
                foreign.setdefault(owner, []).append(f"draft.{name}")
        if foreign:
            told = ", ".join(
                f"{', '.join(sorted(keys))} apply to draft.type={owner} only"
                for owner, keys in foreign.items()
            )
            first = min(next(iter(foreign.values())))
            raise RecipeError(f"{told}, not draft.type={kind}", key=first)
        return raw


class StandaloneDraft(DraftSection):
    """A small causal LM (drafts/standalone/)."""

    own_type = "standalone"


class Eagle3Draft(DraftSection):
    """An EAGLE-3 head on the target's features (drafts/eagle3/, docs/eagle3.md)."""

    own_type = "eagle3"

    aux_layers: Ints | None = recipe_key(
        None, "target layers whose input is fused into the head; null: automatic"
    )
    ttt_steps: int = recipe_key(3, "training-time-test depth K", ge=1)
    intermediate_size: int | None = recipe_key(None, "the head's MLP width; null: the target's")
    norm_before_residual: bool = recipe_key(
        False, "as vLLM's flag of the same name; SGLang supports only false"
    )
    freeze_lm_head: bool = recipe_key(
        False, "keep lm_head at the target's rows of V_d (not trained)"
    )


class ParallelDraft(DraftSection):
    """A causal LM with a mask token that drafts a block in one forward (drafts/parallel/,
    docs/parallel.md)."""

    own_type = "parallel"

    parallel_depths: int = recipe_key(
        4,
        "the depths K trained per position (the block: the last committed token and K - 1 "
        "mask tokens)",
        ge=1,
    )


# draft.type -> its section; a registered type not named here takes `DraftSection`
DRAFT_SECTIONS: dict[str, type[DraftSection]] = {
    s.own_type: s for s in (StandaloneDraft, Eagle3Draft, ParallelDraft)
}


def owner_of(name: str) -> str | None:
    """The draft type whose own key `name` is (None: a common key, or no type's)."""
    if name in DraftSection.model_fields:
        return None
    return next((t for t, s in DRAFT_SECTIONS.items() if name in s.model_fields), None)


def own_fields(section: type[DraftSection]) -> dict[str, Any]:
    """The keys `section` declares beyond the common ones, and their FieldInfo."""
    return {n: f for n, f in section.model_fields.items() if n not in DraftSection.model_fields}


def own_keys() -> dict[str, set[str]]:
    """draft.type -> the dotted keys of that type alone (`draft.ttt_steps`, ...)."""
    return {t: {f"draft.{n}" for n in own_fields(s)} for t, s in DRAFT_SECTIONS.items()}


def _section_tag(value: Any) -> str:
    """The union's member for a draft section as written (or built)."""
    if isinstance(value, DraftSection):
        return value.own_type or OTHER
    kind = value.get("type", DEFAULT_TYPE) if isinstance(value, dict) else DEFAULT_TYPE
    return kind if isinstance(kind, str) and kind in DRAFT_SECTIONS else OTHER


DraftConfig = Annotated[
    Union[  # noqa: UP007 (the members are tagged: Annotated, which `|` does not take)
        Annotated[StandaloneDraft, Tag("standalone")],
        Annotated[Eagle3Draft, Tag("eagle3")],
        Annotated[ParallelDraft, Tag("parallel")],
        Annotated[DraftSection, Tag(OTHER)],
    ],
    Discriminator(_section_tag),
]

_ADAPTER = TypeAdapter(DraftConfig)


def draft_section(raw: dict) -> DraftSection:
    """A draft section from plain data (`{"type": "eagle3", "model": path}`), outside a
    recipe: checked as the recipe checks it (RecipeError)."""
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as e:
        raise translate(e, DraftConfig, "draft") from None
