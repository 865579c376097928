"""The standalone draft type: a small causal LM that shares the target's tokenizer.

One depth: position t of the draft predicts token t+1 from the tokens alone, compared with
the target at the same position (drafts/align.py). Saved as a plain Hugging Face directory,
which is also what serving engines load (docs/theory.md §5).

The draft is a model the recipe names (`draft.model`) or one made of the target's own layers
(`draft.model: target-layers:...`, drafts/draft_init.py): `load_or_init`.

`ReducedStandalone` is this type for a draft whose output head keeps V_d rows only
(`draft.vocab_size`, FR-Spec; the model: drafts/standalone/reduced_vocab.py). Its `name` is
"standalone" and its drafter and offline α are the standalone draft's, reading the full-vocabulary
logits its forward (and the lean forward) returns, −inf outside V_d, so verification is lossless as
for any draft (tests/eval/test_reduced_vocab_engine.py). What differs:

- training compares the draft's K columns with the target on V_d: `depths` asks the draft
  for `full_vocab=False` logits and the type carries the draft's `d2t`, which the losses and
  the held-out α use (losses/api.py: α with the target's raw mass on V_d, KL-style losses
  with p renormalised over V_d);
- the accepted-length loss's chains are sampled from the full-vocabulary logits (q = 0
  outside V_d, so every sampled token is in V_d) and handed to the loss in draft ids;
- export: `hf` writes the K-row directory (this project's tools load it); vLLM and SGLang
  load a draft model with the target's whole output head only, so `vllm` and `sglang` write
  the plain causal LM over the whole vocabulary that it becomes (full_vocab.py).

Its export writers (the plain causal-LM directory every format takes): export.py.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from specdistill.drafts.acceptance_head import align_hidden, save_attached_head
from specdistill.drafts.align import shifted_logits, target_mask
from specdistill.drafts.chains import Chains, sample_chains
from specdistill.drafts.confidence import acceptance_head, predicted_acceptance
from specdistill.drafts.draft_init import draft_from_target, layers_spec
from specdistill.drafts.export import Exports
from specdistill.drafts.registry import register
from specdistill.drafts.standalone import export
from specdistill.drafts.standalone.reduced_vocab import (
    ReducedHead,
    ReducedVocabError,
    compared_ids,
    is_reduced,
    is_reduced_dir,
    reduce_for_data,
)
from specdistill.drafts.types import Capabilities, Depths, DraftControl, Proposal
from specdistill.models import hub
from specdistill.models.kv_cache import KVStream, left_pad


@register(100)  # the fallback: any Hugging Face causal LM
@dataclass(frozen=True)
class Standalone:
    """The standalone draft type (a `drafts.types.DraftType`); `vocab_size` is the logit
    columns compared with the target (`hub.shared_vocab_size`)."""

    vocab_size: int

    name = "standalone"
    d2t = None
    feature_layers = None  # reads the target's logits only
    # every capability; exported as a plain HF directory, which every format holds
    capabilities = Capabilities(
        formats=("vllm", "sglang", "hf"), vllm_speculation={"method": "draft_model"}
    )
    # its export (drafts/export.py): the causal-LM directory in every format (export.py)
    exports = Exports(
        writers={
            "vllm": export.write_causal_lm,
            "sglang": export.write_causal_lm,
            "hf": export.write_causal_lm,
        },
        readers={"vllm": export.read_causal_lm, "hf": export.read_causal_lm},
        hints={"vllm": export.VLLM_HINT, "sglang": export.SGLANG_HINT, "hf": export.VLLM_HINT},
    )
    layout = "hf"  # the export format whose layout a saved standalone draft has

    @staticmethod
    def detect(path) -> bool:
        """Any Hugging Face model directory: the fallback after the other types (`detect`)."""
        return (Path(path) / "config.json").is_file()

    @staticmethod
    def detect_loaded(model) -> bool:
        """Any causal LM: the fallback after the other types (`drafts.type_of`)."""
        return True

    @staticmethod
    def load(name: str, *, dtype: str, revision: str | None = None):
        """A causal LM by name or directory (`models.hub.load_model`, all or nothing)."""
        return hub.load_model(name, dtype=dtype, revision=revision)

    @staticmethod
    def meta_model(path):
        """The causal LM its config.json describes, under the caller's (meta) device."""
        return hub.meta_causal_lm(str(path))

    @classmethod
    def planned(cls, cfg):
        """`ReducedStandalone` for a `draft` section with `draft.vocab_size`, else this type."""
        return ReducedStandalone if cfg.vocab_size is not None else cls

    @classmethod
    def build(cls, cfg, target, tokenizer, train_data, *, print=print):
        """(draft LM, its type) for a recipe's `draft` section: the model of `load_or_init`;
        with `cfg.vocab_size`, or when it has one already, its output head reduced to V_d
        (`ReducedStandalone`); wrapped in a peft LoRA adapter when `cfg.lora.r` > 0."""
        draft = load_or_init(cfg, target, tokenizer)
        if cfg.vocab_size is not None or is_reduced(draft):
            draft, kind = ReducedStandalone.reduce(draft, cfg, target, tokenizer, train_data)
            print(
                f"standalone draft: output vocabulary V_d of {draft.config.draft_vocab_size} "
                f"of the target's {kind.vocab_size} tokens"
            )
        else:
            kind = cls(hub.shared_vocab_size(target, draft, tokenizer))
        if cfg.lora.r > 0:
            draft = wrap_lora(draft, cfg.lora)
        return draft, kind

    def count_mask(self, batch: dict) -> Tensor:
        """The positions a step's loss is normalised by (depth 0's mask)."""
        return target_mask(batch)

    def depths(self, draft, target, batch: dict) -> Depths:
        with torch.no_grad():
            t_logits = shifted_logits(target, batch, self.vocab_size)
        return [shifted_logits(draft, batch, self.vocab_size)], [t_logits], [target_mask(batch)]

    def stored_depths(self, draft, batch: dict, target, features=None) -> Depths:
        """`depths` with the target's log-probabilities over the compared columns stored (a
        `losses.VocabTarget` [B, T−1, V]): no target forward."""
        return [shifted_logits(draft, batch, self.vocab_size)], [target], [target_mask(batch)]

    def draft_ids(self) -> Tensor:
        """The target id of each compared column (`d2t`'s K with a reduced head, else all)."""
        return compared_ids(self.d2t, self.vocab_size)

    def chains(self, draft, target, batch: dict, starts: list[int], **sampling) -> Chains:
        """The draft's own chains from `starts` (drafts/chains.py), for loss.name=tau."""
        return sample_chains(draft, target, batch, starts, vocab_size=self.vocab_size, **sampling)

    head_hidden = staticmethod(align_hidden)  # one recorded head input per depth

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        draft.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        save_attached_head(draft, out)  # its acceptance head's files, when it carries one

    # ------------------------------------------------------------------ a loaded draft
    # Offline α depends on the position only: a round's slot i at start s is α at s + i − 1.
    per_depth_alpha = False
    own_tokenizer = True  # ships its own tokenizer, which must match the target's

    @staticmethod
    def vocab_size_of(model) -> int:
        """Logit columns the draft produces (its output head's rows, maybe padded)."""
        return model.get_output_embeddings().weight.shape[0]

    @staticmethod
    def drafter(model, vocab_size: int, device: torch.device) -> "StandaloneDrafter":
        """The engine's drafter (eval/engine.py) for a loaded draft LM."""
        return StandaloneDrafter(model, vocab_size, device)

    @staticmethod
    def path_logits(target, model, ids: Tensor, n_prompt: int, depth: int, vocab_size: int):
        """Teacher-forced logits along ids [1, T] = prompt + output, for the offline α.

        Returns one (draft logits [S, V], target logits [S, V], mask None) with S = T −
        n_prompt + 1: row j predicts the token after prompt + output[:j]. `depth` is unused
        (depth k of a round at s is row s + k).
        """
        keep = ids.shape[1] - n_prompt + 1
        t_logits = target(input_ids=ids, logits_to_keep=keep).logits[0, :, :vocab_size]
        d_logits = model(input_ids=ids.to(model.device), logits_to_keep=keep).logits
        return [(d_logits[0, :, :vocab_size].to(t_logits.device), t_logits, None)]


def reduced_head(draft) -> ReducedHead:
    """The reduced output head of a draft (inside a peft or DDP wrapper too)."""
    return getattr(draft, "module", draft).get_output_embeddings()


@register(90, variant=True)
@dataclass(frozen=True)
class ReducedStandalone(Standalone):
    """A standalone draft over V_d (module docstring): `vocab_size` the target's columns
    compared; `head` the draft's output head, whose map `d2t` is read where the head is now
    (the buffer follows the draft to its device, and a loaded checkpoint's map with it)."""

    head: ReducedHead = field(compare=False, repr=False)

    @property
    def d2t(self) -> Tensor:
        """The draft's d2t map: draft id i is target id i + d2t[i]."""
        return self.head.d2t

    # training compares V_d columns; export: vLLM / SGLang get the whole vocabulary's head
    capabilities = replace(
        Standalone.capabilities,
        chunked_loss=False,
        vocab_targets=True,
        export_as="reduced_causal_lm",
        # its vLLM export is the draft's own under greedy proposals only (full_vocab.py)
        vllm_speculation={"method": "draft_model", "draft_sample_method": "greedy"},
        refusals={
            "chunked_loss": "loss.chunk_size is not supported with draft.vocab_size (the "
            "draft's V_d logits are small): set loss.chunk_size=null",
        },
    )

    # its export: the K-row directory as hf; over the whole vocabulary for the engines
    exports = Exports(
        writers={
            "vllm": export.write_full_vocab,
            "sglang": export.write_full_vocab,
            "hf": export.write_causal_lm,
        },
        readers={"hf": export.read_causal_lm},
        hints={
            "vllm": export.VLLM_HINT,
            "sglang": export.SGLANG_HINT,
            "hf": "specdistill serve --target {target} --draft {out}",
        },
    )

    @staticmethod
    def detect(path) -> bool:
        """A model directory whose config.json says model_type specdistill_reduced_llama."""
        return is_reduced_dir(path)

    @staticmethod
    def detect_loaded(model) -> bool:
        """A causal LM whose output head is reduced (`is_reduced`)."""
        return is_reduced(model)

    @classmethod
    def reduce(cls, draft, cfg, target, tokenizer, train_data):
        """(draft over V_d, its type) for a recipe's `draft` section (`Standalone.build`): a
        draft with a reduced head already is kept (its saved map; `cfg.vocab_size` must be
        null or its K), else its head is cut to the `cfg.vocab_size` most frequent
        loss-masked tokens of `train_data` (rows taken from its own head)."""
        vocab_size = hub.shared_vocab_size(target, None, tokenizer)
        rows = draft.get_input_embeddings().weight.shape[0]
        if rows < vocab_size:
            raise ReducedVocabError(
                f"the draft's input embedding has {rows} rows but the tokenizer has "
                f"{vocab_size} tokens"
            )
        if is_reduced(draft):
            k = draft.config.draft_vocab_size
            if cfg.vocab_size not in (None, k):
                raise ReducedVocabError(
                    f"draft.model {cfg.model} has a reduced output vocabulary of {k} tokens; "
                    f"draft.vocab_size={cfg.vocab_size} differs: set it to {k} or null"
                )
            if int(draft.lm_head.draft_ids().max()) >= vocab_size:
                raise ReducedVocabError(
                    f"draft.model {cfg.model}: its output vocabulary holds ids past the "
                    f"tokenizer's {vocab_size} tokens"
                )
        else:
            draft = reduce_for_data(draft, cfg.vocab_size, train_data, vocab_size)
        return draft, cls(vocab_size, draft.lm_head)

    def depths(self, draft, target, batch: dict) -> Depths:
        """One depth: the draft's K columns [B, T−1, K] against the target's [B, T−1, V]."""
        with torch.no_grad():
            t_logits = shifted_logits(target, batch, self.vocab_size)
        return [self.own_logits(draft, batch)], [t_logits], [target_mask(batch)]

    def stored_depths(self, draft, batch: dict, target, features=None) -> Depths:
        """`depths` with the target's log-probabilities over the K columns stored
        (a `losses.VocabTarget` [B, T−1, K]): no target forward."""
        return [self.own_logits(draft, batch)], [target], [target_mask(batch)]

    @staticmethod
    def own_logits(draft, batch: dict) -> Tensor:
        """The draft's logits over its own K columns at each position but the last:
        [B, T−1, K], the columns a `losses.VocabTarget` is stored in (`draft_ids` order)."""
        out = draft(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], full_vocab=False
        )
        return out.logits[:, :-1]

    def chains(self, draft, target, batch: dict, starts: list[int], **sampling) -> Chains:
        """The draft's own chains (drafts/chains.py), sampled from its full-vocabulary logits
        (q = 0 outside V_d); its logits and tokens handed on over V_d, as the loss takes them
        with `d2t`."""
        if sampling.get("hidden"):
            raise ReducedVocabError(
                "loss tau with a reduced output vocabulary (draft.vocab_size) runs unchunked: "
                "set loss.chunk_size=null"
            )
        chains = sample_chains(draft, target, batch, starts, vocab_size=self.vocab_size, **sampling)
        head = reduced_head(draft)
        ids = head.draft_ids().to(chains.draft.device)
        return Chains(
            chains.draft.index_select(-1, ids),
            chains.target,
            head.to_draft_ids(chains.tokens),
            chains.mask,
        )

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        """`Standalone.save`, after checking the map the draft carries (`check_vocab_map`)."""
        reduced_head(draft).check(f"the draft saved to {out}")
        super().save(draft, out, tokenizer, verifier)

    # ------------------------------------------------------------------ a loaded draft
    @staticmethod
    def vocab_size_of(model) -> int:
        """Logit columns the draft's forward produces: its full input vocabulary (−inf
        outside V_d), not its head's K rows."""
        return reduced_head(model).vocab_size


class StandaloneDrafter:
    """A standalone draft LM on its own KV cache, proposing from the committed tokens.

    Its cache holds every committed token but the `pending` ones of each row (the last
    committed token, plus d_γ after a fully accepted round).
    """

    target_first_token = False  # the first token comes from a speculative round

    def __init__(self, model, vocab_size: int, device: torch.device):
        self.stream = KVStream(model, vocab_size, device)
        self.pending: list = []
        self.device = device

    def capture(self, target):
        """What the target's stream must capture for this drafter: nothing (the tokens do)."""
        return None

    def admit(self, prompts: Sequence[Sequence[int]], features=None) -> None:
        """New rows: the cache takes all of each prompt but its last token, which is pending."""
        self.stream.admit([p[:-1] for p in prompts])
        self.pending += [[p[-1]] for p in prompts]

    def propose(self, gamma: int, sample, control: DraftControl | None = None) -> Proposal:
        """Draft up to γ tokens per row (`drafts.types.Proposal`).

        `sample(logits [B, V]) -> (tokens [B], probs [B, V] | None)` is the draft's sampler;
        verification uses the very q it returns. With a `control`, each step's predicted
        acceptance (drafts/confidence.py) goes to `control.keep_drafting`, which may end
        the round's drafting early.
        """
        tokens, valid, inputs = self._first_inputs()
        model = self.stream.model
        head = control is not None and acceptance_head(model) is not None
        extra = self._hidden_inputs() if head else {}
        one = torch.ones(len(self.pending), 1, dtype=torch.bool, device=self.device)
        drafted, q, confidence = [], [], []
        for step in range(1, gamma + 1):
            logits = self.stream.forward(tokens, valid, keep=1, **inputs, **extra)[:, -1]
            token, probs = sample(logits)
            drafted.append(token)
            q.append(probs)
            if control is not None:
                hidden = self._last_hidden() if head else None
                confidence.append(predicted_acceptance(model, logits, token, probs, hidden))
                if not control.keep_drafting(step, confidence[-1]):
                    break
            tokens, valid, inputs = token[:, None], one, self._next_inputs()
        return Proposal(
            torch.stack(drafted, dim=1), q, torch.stack(confidence, dim=1) if confidence else None
        )

    def _hidden_inputs(self) -> dict:
        """Extra arguments of the stream's forward that make it keep the hidden state the
        acceptance head reads (for a head). `hidden=True` keeps the stream on the lean forward
        (models/lean.py) where it runs the model, and on transformers' forward otherwise."""
        return {"hidden": True}

    def _last_hidden(self) -> Tensor:
        """The last forward's final hidden state at its last position [B, H] (what the LM
        head reads)."""
        return self.stream.hidden[:, -1]

    def _first_inputs(self) -> tuple[Tensor, Tensor, dict]:
        """(tokens [B, k], valid [B, k], extra model inputs) of a round's first draft step."""
        return *left_pad(self.pending, self.device), {}

    def _next_inputs(self) -> dict:
        """Extra model inputs of the following draft steps."""
        return {}

    def commit(self, gamma: int, n_accepted: Tensor, host: list, features=None) -> None:
        """After verification: host[i] = [n_i, next_i, *drafts_i]."""
        if gamma == 0:  # a target-only round: the new token joins the pending ones
            for i, (_, next_i) in enumerate(host):
                self.pending[i] = list(self.pending[i]) + [next_i]
            return
        # The draft cached d_1..d_{γ-1} and keeps d_1..d_n, so after a fully accepted round
        # d_γ is still pending next to the new token.
        for i, (n_i, next_i, *drafts_i) in enumerate(host):
            self.pending[i] = [drafts_i[-1], next_i] if n_i == gamma else [next_i]
        self.stream.drop_last((gamma - 1) - n_accepted.clamp_max(gamma - 1))

    def select_rows(self, keep: list[int], index: Tensor) -> None:
        """Keep the rows at positions `keep` (also as `index` [n] on the device)."""
        self.pending = [self.pending[i] for i in keep]
        self.stream.select_rows(index)


def load_or_init(cfg, target, tokenizer):
    """The causal LM a recipe's `draft` section names: for `cfg.model` target-layers:...,
    one made of the target's own layers (drafts/draft_init.py), else the model `cfg.model`
    loaded like any HF model and checked to share the target's tokenizer; in `cfg.dtype`."""

    layers = layers_spec(cfg.model)
    if layers is not None:
        return draft_from_target(target, layers).to(hub.DTYPES[cfg.dtype])
    draft_tok = hub.load_tokenizer(cfg.model, cfg.revision)
    hub.check_tokenizers(tokenizer, draft_tok, target.name_or_path, cfg.model)
    return hub.load_model(cfg.model, dtype=cfg.dtype, revision=cfg.revision)


def wrap_lora(draft, lora):
    """`draft` inside a peft LoRA adapter (`lora`: r, alpha, dropout, target_modules); merged
    back into the weights when the trained draft is saved."""
    # lazy: peft is slow to import; only a LoRA draft needs it
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(draft, config)
