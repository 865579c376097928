"""The interface of a draft type (`DraftType`) and of its engine-side proposer (`Drafter`).

The trainer, the offline evaluation, the engine, the server and the export call a draft type
through these members only and never branch on which type it is. A type's class
(drafts/standalone/ `Standalone`, drafts/eagle3/ `Eagle3`) declares what it can do
(`capabilities`: what the recipe checks, the online job and the export ask) and answers the
questions about a recipe's `draft` section (`planned`), about a loaded draft module
(`detect_loaded`, `vocab_size_of`, `drafter`, `path_logits`, `per_depth_alpha`,
`own_tokenizer`) and about directories (`detect`, `layout`, `load`, `meta_model`), and
contributes its export writers, readers and serve hints (`exports`, drafts/export.py); each
registers itself (drafts/registry.py), which asks these in its declared priority order;
an instance, built with the draft for training (`build`), answers the training-time ones
(`depths`, `count_mask`, `save`, `vocab_size`, `d2t`). Instances are never mutated after `build`.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from specdistill.drafts.export import Exports

# K aligned depths: (draft logits per depth, target logits per depth, mask per depth).
Depths = tuple[list[Tensor], list[Tensor], list[Tensor]]

# Teacher-forced logits of the offline α: per depth (draft logits, target logits, mask | None).
PathLogits = list[tuple[Tensor, Tensor, Tensor | None]]


@dataclass
class Proposal:
    """One round's drafts, as a drafter proposes them.

    tokens [B, k]: k ≤ γ draft steps (fewer when a `DraftControl` stopped early); q: per step
    the draft distribution [B, V] each token was drawn from, or None when greedy;
    confidence [B, k]: per step the predicted probability that the target accepts the
    token (drafts/confidence.py), or None when no control asked for it.
    """

    tokens: Tensor
    q: list
    confidence: Tensor | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a draft type can do, declared on its class (`DraftType.capabilities`): the
    recipe checks, the online job and the export ask it, never the type's name. A recipe
    that asks for a capability its type lacks is refused with the type's own one-line error
    for it (`refusals`), else a generic one naming the type (train/recipe_checks.py)."""

    fresh: bool = False  # draft.model may be null: a new draft built on the target
    lora: bool = True  # draft.lora: a LoRA adapter trained instead of the whole draft
    chunked_loss: bool = True  # loss.chunk_size: the loss from hidden states, chunk by chunk
    # a top-N target with a rest bin: target.cache, or the online records' top_logprobs
    sparse_targets: bool = True
    # target.cache with --columns draft: the target's log-probabilities over the draft's own
    # columns (`losses.VocabTarget`), exact for a draft over a reduced vocabulary
    vocab_targets: bool = False
    accepted_length: bool = True  # loss tau: the accepted length of the draft's own chains
    writes_text: bool = True  # data.on_policy.source=draft: it drafts a text on its own
    formats: tuple[str, ...] = ("hf",)  # export formats (train/export/)
    format_note: str | None = None  # why the formats are fewer, for the export's refusal
    # the key of the type's `exports` in the export's tables (train/export/): types written
    # alike (a type and its variants) share it and one `Exports`
    export_as: str = "causal_lm"
    # the keys of vLLM's `speculative_config` (beside the model and the number of tokens)
    # that decode the type's `vllm` export; empty: vLLM does not decode it
    vllm_speculation: Mapping[str, object] = field(default_factory=dict)
    # capability -> the one-line error of a recipe that asks for it
    refusals: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        names = {f.name for f in fields(self) if isinstance(f.default, bool)}
        unknown = sorted(set(self.refusals) - names)
        if unknown:
            raise ValueError(f"refusals of unknown capabilities {unknown}; known: {sorted(names)}")

    def refusal(self, capability: str, generic: str) -> str | None:
        """None when the type has `capability`; else the one-line error of a recipe that
        asks for it: the type's own, or `generic`."""
        if getattr(self, capability):
            return None
        return self.refusals.get(capability, generic)


@runtime_checkable
class DraftControl(Protocol):
    """Decides, after each draft step, whether the batch drafts another token."""

    def keep_drafting(self, step: int, confidence: Tensor) -> bool:
        """`step` tokens drafted so far; confidence [B]: the predicted acceptance of the
        token just drafted, per row. False: the round's drafting ends here."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """The engine's proposer (eval/batch.py) for a loaded draft, on its own KV cache."""

    target_first_token: bool  # the target prefills the whole prompt and samples token 1

    def capture(self, target) -> Any:
        """What the target's KV stream must capture for this drafter (None: nothing)."""
        ...

    def admit(self, prompts: Sequence[Sequence[int]], features=None) -> None:
        """New rows join with their prompts (and the target's features, when captured)."""
        ...

    def propose(
        self, gamma: int, sample: Callable, control: DraftControl | None = None
    ) -> Proposal:
        """Up to γ drafts per row (γ exactly without `control`; with it, the confidences
        too, and drafting ends when the control says so)."""
        ...

    def commit(self, gamma: int, n_accepted: Tensor, host: list, features=None) -> None:
        """After verification of γ ≥ 0 drafts: host[i] = [n_i, next_i, *drafts_i]."""
        ...

    def select_rows(self, keep: list[int], index: Tensor) -> None:
        """Keep the rows at positions `keep` (also as `index` [n] on the device)."""
        ...


@runtime_checkable
class DraftType(Protocol):
    """Everything that differs between draft types, as the rest of the project calls it."""

    name: ClassVar[str]  # "standalone", "eagle3": the recipe's draft.type
    capabilities: ClassVar[Capabilities]  # what it can do (the recipe checks, the export)
    layout: ClassVar[str]  # the export format whose layout a saved draft of this type has
    # its export writers, readers and serve hints per format (drafts/export.py)
    exports: ClassVar[Exports]
    per_depth_alpha: ClassVar[bool]  # offline α depends on the drafting depth
    own_tokenizer: ClassVar[bool]  # ships its own tokenizer (which must match the target's)

    vocab_size: int  # logit columns compared with the target in training
    d2t: Tensor | None  # draft-to-target id offsets when the draft vocabulary is smaller
    # the decoder layers whose input hidden states the type reads from the target besides its
    # logits (what a target cache stores for it: train/target_cache.py), or None
    feature_layers: list[int] | None

    @staticmethod
    def detect(path) -> bool:
        """Whether a directory holds a draft of this type (in this layout)."""
        ...

    @staticmethod
    def detect_loaded(model) -> bool:
        """Whether a loaded draft module is of this type (drafts/registry.py `type_of`)."""
        ...

    @staticmethod
    def load(name: str, *, dtype: str, revision: str | None = None) -> Any:
        """The draft module `name` (a directory this type `detect`s, or a hub name for the
        fallback type), all or nothing (drafts/loader.py)."""
        ...

    @staticmethod
    def meta_model(path) -> Any:
        """The module the config in directory `path` describes, built under the caller's
        device context (the meta device: drafts/checked_load.py reads its shapes)."""
        ...

    @classmethod
    def planned(cls, cfg) -> type["DraftType"]:
        """The type class `build` makes for a recipe's `draft` section, as far as the section
        tells (e.g. its reduced-vocabulary variant for `draft.vocab_size`): whose
        `capabilities` the recipe checks ask."""
        ...

    @classmethod
    def build(cls, cfg, target, tokenizer, train_data, *, print=print) -> tuple[Any, "DraftType"]:
        """(draft module, type instance) for a recipe's `draft` section."""
        ...

    def count_mask(self, batch: dict) -> Tensor:
        """The positions a step's loss is normalised by."""
        ...

    def depths(self, draft, target, batch: dict) -> Depths:
        """K aligned (draft logits, target logits, mask) depths of a batch."""
        ...

    def stored_depths(self, draft, batch: dict, target, features: Tensor | None = None) -> Depths:
        """`depths` from the target's stored outputs (train/target_cache.py, or the online
        job's logged top-k) at every position but the last: `target` its log-probabilities
        over the draft's own columns, a `losses.VocabTarget` [B, T−1, K] (types with the
        `vocab_targets` capability), or its top-N over the target's ids, a
        `losses.SparseTarget` (types with `sparse_targets`); `features` [B, T, F] the hidden
        states entering `feature_layers` (None without)."""
        ...

    def draft_ids(self) -> Tensor:
        """The target id of each column the draft is compared on (a target cache over the
        draft's own columns is stored in this order)."""
        ...

    def chains(self, draft, target, batch: dict, starts: list[int], **sampling) -> Any:
        """The draft's own γ-token chains from positions `starts` of the batch, scored by the
        target (`drafts.chains.Chains`; sampling: gamma, temperature, generator, hidden),
        for the accepted-length loss; a type that cannot sample them raises a UserError."""
        ...

    def head_hidden(self, captured: list[Tensor], draft_logits: list[Tensor]) -> list[Tensor]:
        """The acceptance head's inputs per depth: the hidden states its recorder caught
        during `depths` (drafts/acceptance_head.py `HeadInputs`), aligned with the depths'
        draft logits."""
        ...

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        """Write a trained draft to the directory `out`."""
        ...

    @staticmethod
    def vocab_size_of(model) -> int:
        """Logit columns a loaded draft module produces."""
        ...

    @staticmethod
    def drafter(model, vocab_size: int, device: torch.device) -> Drafter:
        """The engine's drafter for a loaded draft module."""
        ...

    @staticmethod
    def path_logits(
        target, model, ids: Tensor, n_prompt: int, depth: int, vocab_size: int
    ) -> PathLogits:
        """Teacher-forced logits along ids [1, T] = prompt + output, for the offline α."""
        ...
