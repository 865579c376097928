"""A standalone draft with a reduced output vocabulary (FR-Spec, arXiv 2502.14856).

A small draft's cost on a large-vocabulary target is dominated by its output head (SmolLM2:
576 × 49,152). This draft keeps the target's whole input embedding (it reads any token) but
only K rows of the output head: the K most frequent target tokens of the training data, V_d.
The map is the EAGLE-3 head's (drafts/vocab_map.py): target_id = i + d2t[i] for draft id
i, t2d[v] True for the V_d target ids, checked on every build and load (`check_vocab_map`).

The model is a Hugging Face Llama causal LM (`ReducedVocabLlamaForCausalLM`, config
`ReducedVocabLlamaConfig`: `vocab_size` the full vocabulary, `draft_vocab_size` K) whose
`lm_head` (`ReducedHead`: K rows plus the d2t / t2d buffers) maps its K columns back into the
target's ids. Its forward returns logits over the full vocabulary with −inf outside V_d (q = 0
there, so verification stays lossless: a token outside V_d is never proposed), or with
`full_vocab=False` the K columns themselves, which is what training compares (with `d2t`,
losses/api.py). Saved by `save_pretrained` as an ordinary model directory (config.json's
`model_type` is `MODEL_TYPE`); this module registers the classes with transformers' Auto
classes when the drafts package is imported, so `models.hub.load_model` loads it with the
same all-or-nothing weight checks as any draft. The lean CPU forward (models/lean.py) runs
the K-row head and maps its columns the same way (`ReducedHead.to_target_vocab`).
"""

import json
from pathlib import Path

import torch
from huggingface_hub.dataclasses import strict
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaModel, LlamaPreTrainedModel

from specdistill.drafts.vocab_map import (
    build_vocab_map,
    check_vocab_map,
    logits_to_target,
    token_counts,
)
from specdistill.errors import UserError
from specdistill.models import lean
from specdistill.models.kv_cache import cache_keyword

# The output's cache field: `cache` in newer transformers, `past_key_values` before.
_CACHE_FIELDS = [
    name
    for name in ("cache", "past_key_values")
    if name in CausalLMOutputWithPast.__dataclass_fields__
]

MODEL_TYPE = "specdistill_reduced_llama"  # config.json's model_type of a reduced-vocab draft
# The causal LMs a reduced output head can be put on (their modules are Llama's).
SUPPORTED = ("llama", MODEL_TYPE)


class ReducedVocabError(UserError):
    """A draft that cannot get, or does not have, the reduced output vocabulary asked for."""


@strict
class ReducedVocabLlamaConfig(LlamaConfig):
    """A Llama config whose output head has `draft_vocab_size` rows (V_d) while `vocab_size`
    (the input embedding, and the columns of the full-vocabulary logits) stays the target's."""

    model_type = MODEL_TYPE
    draft_vocab_size: int = 1


def compared_ids(d2t: Tensor | None, vocab_size: int) -> Tensor:
    """The target id of each column a draft type is compared on: the K of its d2t map
    (draft id i is target id i + d2t[i]), or all `vocab_size` ids in order without one."""
    if d2t is None:
        return torch.arange(vocab_size)
    return torch.arange(len(d2t), device=d2t.device) + d2t


class ReducedHead(nn.Linear):
    """The output head over V_d: a bias-free [K, H] linear layer with the vocabulary map
    (buffers d2t [K] int64, t2d [V] bool) that places its K columns among the V target ids."""

    def __init__(self, hidden_size: int, draft_vocab_size: int, vocab_size: int):
        super().__init__(hidden_size, draft_vocab_size, bias=False)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True  # a placeholder map until `set_vocab_map` or a load
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d)

    @property
    def vocab_size(self) -> int:
        return self.t2d.shape[0]

    def draft_ids(self) -> Tensor:
        """Target id of every draft id: [K]."""
        return torch.arange(self.out_features, device=self.d2t.device) + self.d2t

    def set_vocab_map(self, d2t: Tensor, t2d: Tensor) -> None:
        check_vocab_map(d2t, t2d, self.vocab_size, self.out_features)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def check(self, source: str) -> None:
        """`VocabMapError` (naming `source`) unless the map fits this head."""
        try:
            check_vocab_map(self.d2t, self.t2d, self.vocab_size, self.out_features)
        except UserError as e:
            raise type(e)(f"{source}: {e}") from None

    def to_target_vocab(self, logits: Tensor) -> Tensor:
        """[..., K] -> [..., V] with −inf outside V_d."""
        return logits_to_target(logits, self.draft_ids(), self.vocab_size)

    def to_draft_ids(self, tokens: Tensor) -> Tensor:
        """Target ids in V_d -> their draft ids (same shape)."""
        return (self.t2d.long().cumsum(0) - 1)[tokens]


class ReducedVocabLlamaForCausalLM(LlamaForCausalLM):
    """A Llama causal LM whose output head covers V_d only (module docstring)."""

    config_class = ReducedVocabLlamaConfig
    config: ReducedVocabLlamaConfig
    _tied_weights_keys = {}  # noqa: RUF012 (transformers' attribute): the K-row head is untied

    def __init__(self, config: ReducedVocabLlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = ReducedHead(config.hidden_size, config.draft_vocab_size, config.vocab_size)
        self.post_init()

    @property
    def d2t(self) -> Tensor:
        return self.lm_head.d2t

    @property
    def t2d(self) -> Tensor:
        return self.lm_head.t2d

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache=None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        full_vocab: bool = True,
        past_key_values=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """transformers' causal-LM forward; logits over the full vocabulary with −inf outside
        V_d, or (`full_vocab=False`) over V_d: [B, kept, K]. The KV cache comes as `cache`
        or (transformers before `cache`'s name) `past_key_values`, and goes on to the inner
        model under the name its version takes."""
        kwargs[cache_keyword(self.model)] = cache if cache is not None else past_key_values
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        if full_vocab:
            logits = self.lm_head.to_target_vocab(logits)
        past = {key: getattr(out, key) for key in _CACHE_FIELDS}
        return CausalLMOutputWithPast(
            logits=logits, hidden_states=out.hidden_states, attentions=out.attentions, **past
        )

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' load, then the vocabulary map checked (`VocabMapError`) when the
        weights loaded whole; a partial load is left to the caller's weight checks
        (models/weights.py), which name the missing tensors."""
        asked = kwargs.get("output_loading_info", False)
        kwargs["output_loading_info"] = True
        model, info = super().from_pretrained(*args, **kwargs)
        if not any(info.get(k) for k in ("missing_keys", "mismatched_keys")):
            model.lm_head.check(str(args[0]) if args else "draft")
        return (model, info) if asked else model


AutoConfig.register(MODEL_TYPE, ReducedVocabLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(ReducedVocabLlamaConfig, ReducedVocabLlamaForCausalLM, exist_ok=True)
lean.support(MODEL_TYPE, ReducedHead)  # the lean CPU forward runs its K-row head


def is_reduced(model) -> bool:
    """Whether a loaded draft module (maybe inside a peft or DDP wrapper) has a reduced head."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == MODEL_TYPE


def is_reduced_dir(path) -> bool:
    """Whether a directory holds a reduced-vocabulary draft (config.json's model_type)."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def with_reduced_head(model, d2t: Tensor, t2d: Tensor) -> ReducedVocabLlamaForCausalLM:
    """A Llama causal LM `model` (the full vocabulary) with its output head cut to the V_d of
    the map: the same weights, the head's rows of V_d (an untied copy of the embedding's when
    it is tied). `t2d` covers the model's input vocabulary."""
    family = getattr(model.config, "model_type", None)
    if family != "llama":
        raise ReducedVocabError(
            f"a reduced output vocabulary (draft.vocab_size) needs a Llama-family draft "
            f"(model_type llama); this draft's model_type is {family!r}"
        )
    fields = model.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    fields.update(draft_vocab_size=int(d2t.shape[0]), tie_word_embeddings=False)
    config = ReducedVocabLlamaConfig(**fields)
    config.architectures = [ReducedVocabLlamaForCausalLM.__name__]
    weight = model.get_output_embeddings().weight
    check_vocab_map(d2t, t2d, config.vocab_size, config.draft_vocab_size)
    reduced = ReducedVocabLlamaForCausalLM(config).to(device=weight.device, dtype=weight.dtype)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    ids = (torch.arange(d2t.shape[0]) + d2t).to(weight.device)
    state |= {"lm_head.weight": weight.detach()[ids], "lm_head.d2t": d2t, "lm_head.t2d": t2d}
    reduced.load_state_dict(state, strict=True)  # copies: `model` is left as it was
    reduced.generation_config = model.generation_config
    return reduced.train(model.training)


def add_input_row(model: ReducedVocabLlamaForCausalLM) -> int:
    """One more input token for a reduced-head draft (a parallel draft's mask token): an
    embedding row initialised to the mean of the others; the K-row output head is kept and
    its map covers the new id outside V_d (never proposed). -> the new id."""
    old = model.get_input_embeddings()
    rows, width = old.weight.shape
    new = nn.Embedding(
        rows + 1,
        width,
        padding_idx=old.padding_idx,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )
    with torch.no_grad():
        new.weight[:rows] = old.weight
        new.weight[rows] = old.weight.mean(dim=0)
    model.set_input_embeddings(new)
    head = model.lm_head
    head.t2d = torch.cat([head.t2d, head.t2d.new_zeros(1)])  # a registered buffer, replaced
    model.config.vocab_size = model.vocab_size = rows + 1
    return rows


def output_columns(model) -> int:
    """The logit columns a causal LM's forward returns: a reduced head's full vocabulary
    (−inf outside V_d), else its output head's rows."""
    head = getattr(model, "module", model).get_output_embeddings()
    return head.vocab_size if isinstance(head, ReducedHead) else head.weight.shape[0]


def reduce_for_data(model, draft_vocab_size: int, train_data, vocab_size: int):
    """`with_reduced_head` for the `draft_vocab_size` most frequent loss-masked tokens of
    `train_data` among the first `vocab_size` ids (those the shared tokenizer produces)."""
    rows = model.get_input_embeddings().weight.shape[0]
    if not 0 < draft_vocab_size <= vocab_size:
        raise ReducedVocabError(
            f"draft.vocab_size must be in [1, {vocab_size}] (the target's vocabulary), got "
            f"{draft_vocab_size}"
        )
    d2t, t2d = build_vocab_map(token_counts(train_data, vocab_size), draft_vocab_size)
    full = torch.zeros(rows, dtype=torch.bool)
    full[:vocab_size] = t2d
    return with_reduced_head(model, d2t, full)
