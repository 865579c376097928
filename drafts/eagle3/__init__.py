"""The EAGLE-3 draft type: a head on the target's features (the module: drafts/eagle3/head.py).

K = `draft.ttt_steps` depths of training-time test, each aligned with the target by
`align_depths`; the target's features are captured in the same forward that gives its
logits. Saved in the `speculators` layout vLLM loads (docs/theory.md §4, §5).

This subpackage is the whole type: the head (head.py), its checkpoint format and directory
detection (checkpoint.py), the target's feature capture (features.py), its chains for the
accepted-length loss (chains.py), its export writers (export.py: the speculators layout of
the vllm and hf formats; sglang.py: SGLang's), and here the type with its hooks and
registration.
"""

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from specdistill.bounds import check_int
from specdistill.drafts.acceptance_head import align_hidden, save_attached_head
from specdistill.drafts.eagle3 import export as speculators
from specdistill.drafts.eagle3 import sglang
from specdistill.drafts.eagle3.chains import sample_head_chains
from specdistill.drafts.eagle3.checkpoint import head_from_config, read_config
from specdistill.drafts.eagle3.head import (
    Eagle3Head,
    FeatureCapture,
    align_depths,
    build_vocab_map,
    is_eagle3_dir,
    is_sglang_eagle3_dir,
)
from specdistill.drafts.export import Exports
from specdistill.drafts.registry import register
from specdistill.drafts.standalone import Standalone, StandaloneDrafter
from specdistill.drafts.standalone.reduced_vocab import ReducedVocabError, compared_ids
from specdistill.drafts.types import Capabilities, Depths
from specdistill.drafts.vocab_map import token_counts
from specdistill.losses import VocabTarget
from specdistill.models import hub
from specdistill.models.kv_cache import left_pad, left_pad_rows
from specdistill.models.weights import check_module_finite


@register(10)
class Eagle3:
    """The EAGLE-3 draft type (a `drafts.types.DraftType`): K = `steps` depths over the
    target's `vocab_size` columns; `d2t` maps the head's draft vocabulary into the target's
    when it is smaller (else None). Built from a head, and not changed after."""

    name = "eagle3"
    capabilities = Capabilities(
        fresh=True,  # draft.model null: a new head on the target, its V_d from the data
        lora=False,
        chunked_loss=False,
        sparse_targets=False,
        vocab_targets=True,  # target.cache over its V_d columns, with the features it reads
        writes_text=False,
        formats=("vllm", "sglang", "hf"),
        export_as="eagle3_head",
        vllm_speculation={"method": "eagle3"},
        refusals={
            "lora": "draft.lora applies to a standalone draft; an eagle3 head is trained in full",
            "chunked_loss": "loss.chunk_size is not supported for draft.type=eagle3 (its V_d "
            "logits are small); set loss.chunk_size=null",
            "sparse_targets": "target.cache is a top-N cache, which holds neither the "
            "target over the head's own columns nor the hidden states it reads: build the "
            "cache for this recipe (`specdistill prepare`, or `specdistill cache --columns "
            "draft`)",
            "writes_text": "data.on_policy.source=draft needs a standalone draft: an eagle3 "
            "head drafts from the target's features and cannot write a text alone; use "
            "data.on_policy.source=target (speculative decoding with the head)",
        },
    )
    # its export (drafts/export.py): the speculators layout as vllm and hf, SGLang's as sglang
    exports = Exports(
        writers={
            "vllm": speculators.write_head,
            "sglang": sglang.write_head,
            "hf": speculators.write_head,
        },
        readers={
            "vllm": speculators.read_head,
            "sglang": sglang.read_head,
            "hf": speculators.read_head,
        },
        hints={"vllm": speculators.HINT, "sglang": sglang.HINT, "hf": speculators.HINT},
    )
    layout = "vllm"  # a saved head is in the speculators layout (`Eagle3Head.save_pretrained`)

    @staticmethod
    def detect(path) -> bool:
        """A head in the speculators layout: config.json with speculators_model_type eagle3."""
        return is_eagle3_dir(path)

    @staticmethod
    def detect_loaded(model) -> bool:
        """An EAGLE-3 head (it says `is_eagle3`)."""
        return getattr(model, "is_eagle3", False)

    @staticmethod
    def load(name: str, *, dtype: str, revision: str | None = None) -> Eagle3Head:
        """The head saved in the local directory `name`, refused unless its weights cover its
        config and hold no NaN or infinity (`revision` is a hub name's: unused)."""
        path = hub.local_model_dir(name) or name
        model = Eagle3Head.from_pretrained(path, dtype=hub.DTYPES[dtype])
        check_module_finite(path, model)
        return model

    @staticmethod
    def meta_model(path) -> Eagle3Head:
        """The head its speculators config describes, under the caller's (meta) device."""
        return head_from_config(Eagle3Head, read_config(path))

    @classmethod
    def planned(cls, cfg):
        """This type: a head's V_d (`draft.vocab_size`) is its own."""
        return cls

    def __init__(self, head: Eagle3Head, steps: int, vocab_size: int):
        if steps < 1:
            raise ValueError(f"draft.ttt_steps must be >= 1, got {steps}")
        self.steps, self.vocab_size = steps, vocab_size
        self.feature_layers = list(head.aux_layers)  # captured live; a target cache stores them
        self.dtype = head.fc.weight.dtype
        self.d2t = head.d2t if head.draft_vocab_size < vocab_size else None

    @classmethod
    def build(cls, cfg, target, tokenizer, train_data, *, print=print):
        """(head, its type) for a recipe's `draft` section: a fresh head on `target` (its V_d
        from the loss-masked tokens of `train_data`) when `cfg.model` is null, else the head
        saved in that directory, which must cover the target's vocabulary."""
        vocab_size = hub.shared_vocab_size(target, None, tokenizer)
        if cfg.vocab_size is not None:  # before a head of that many rows is allocated
            check_int("draft.vocab_size", cfg.vocab_size, 1, vocab_size, "the target's vocabulary")
        if cfg.model is None:
            head = new_eagle3_head(target, cfg, train_data, vocab_size)
        elif cls.detect(cfg.model):
            head = Eagle3Head.from_pretrained(cfg.model)
            if head.config.vocab_size != vocab_size:
                raise ValueError(
                    f"draft.model {cfg.model} is a head over {head.config.vocab_size} tokens; "
                    f"the target's tokenizer has {vocab_size}"
                )
            if cfg.vocab_size not in (None, head.draft_vocab_size):
                raise ReducedVocabError(
                    f"draft.model {cfg.model} is a head with V_d {head.draft_vocab_size}; "
                    f"draft.vocab_size={cfg.vocab_size} differs: set it to "
                    f"{head.draft_vocab_size} or null"
                )
        else:
            raise ValueError(
                f"draft.type=eagle3: draft.model must be null (a fresh head) or an EAGLE-3 "
                f"checkpoint directory, got {cfg.model!r}"
            )
        head.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
        trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
        print(
            f"eagle3 head: aux layers {head.aux_layers}, V_d {head.draft_vocab_size}, "
            f"{trainable / 1e6:.2f}M trainable parameters"
        )
        head = head.to(hub.DTYPES[cfg.dtype])
        return head, cls(head, cfg.ttt_steps, vocab_size)

    def count_mask(self, batch: dict) -> Tensor:
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        length = valid.shape[1] - self.steps - 1
        return valid[:, 2 : 2 + length]

    def target_forward(self, target, batch: dict) -> tuple[Tensor, Tensor]:
        """(target logits [B, T, vocab], features [B, T, n_aux·H_t]) from one forward."""
        with torch.no_grad(), FeatureCapture(target, self.feature_layers) as capture:
            out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return out.logits[..., : self.vocab_size], capture.features()

    def depths(self, draft, target, batch: dict) -> Depths:
        t_logits, features = self.target_forward(target, batch)
        # Through forward (not .unroll) so that a DDP / FSDP wrapper sees the call.
        logits = draft(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            features=features.to(self.dtype),
            ttt_steps=self.steps,
        )
        return align_depths(logits, t_logits, batch["loss_mask"], batch["attention_mask"])

    def stored_depths(self, draft, batch: dict, target: VocabTarget, features: Tensor) -> Depths:
        """`depths` from the target's stored outputs: its log-probabilities over the head's
        columns [B, T−1, K] and the features [B, T, F] it drafts from; no target forward."""
        logits = draft(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            features=features.to(self.dtype),
            ttt_steps=self.steps,
        )
        # align_depths takes the target at every position: the last predicts nothing (masked)
        logp = nn.functional.pad(target.logp, (0, 0, 0, 1))
        drafts, targets, masks = align_depths(
            logits, logp, batch["loss_mask"], batch["attention_mask"]
        )
        return drafts, [VocabTarget(t) for t in targets], masks

    def draft_ids(self) -> Tensor:
        """The target id of each of the head's K columns (a target cache's column order)."""
        return compared_ids(self.d2t, self.vocab_size)

    def chains(self, draft, target, batch: dict, starts: list[int], **sampling):
        """The head's own chains from `starts`, scored by the target (drafts/eagle3/chains.py),
        for loss.name=tau."""
        _, features = self.target_forward(target, batch)
        head = getattr(draft, "module", draft)  # the bare head's d2t under a DDP wrapper
        return sample_head_chains(
            draft,
            target,
            features.to(self.dtype),
            batch,
            starts,
            vocab_size=self.vocab_size,
            d2t=head.d2t,
            **sampling,
        )

    head_hidden = staticmethod(align_hidden)  # one recorded head input per depth

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        draft.ttt_steps = self.steps  # recorded in config.json: the export's speculative tokens
        draft.save_pretrained(out, verifier=verifier)
        tokenizer.save_pretrained(out)
        save_attached_head(draft, out)  # its acceptance head's files, when it carries one

    # ------------------------------------------------------------------ a loaded head
    # Offline α depends on the drafting depth: the head drafts from its own hidden states.
    per_depth_alpha = True
    own_tokenizer = False  # uses the target's tokenizer; its vocabulary must fit in it

    @staticmethod
    def vocab_size_of(head) -> int:
        """Logit columns the head produces: the target vocabulary V (−inf outside V_d)."""
        return head.config.vocab_size

    @staticmethod
    def drafter(head, vocab_size: int, device: torch.device) -> "Eagle3Drafter":
        """The engine's drafter (eval/engine.py) for a loaded head."""
        return Eagle3Drafter(head, vocab_size, device)

    @staticmethod
    def path_logits(target, head, ids: Tensor, n_prompt: int, depth: int, vocab_size: int):
        """Teacher-forced logits along ids [1, T] = prompt + output, for the offline α.

        Returns `depth` triples (draft logits [S, V], target logits [S, V], mask [S]) with
        S = T − n_prompt + 1: row s of depth k is the k-th draft (0-based) of a round that
        starts at generated position s (it predicts output[s + k]), the head unrolled on the
        text as in training; masked where the text runs out.
        """
        with FeatureCapture(target, head.aux_layers) as capture:
            t_logits = target(input_ids=ids).logits[0, :, :vocab_size]
        steps = head.unroll(capture.features().to(head.fc.weight.dtype), ids, None, depth)
        length = ids.shape[1]
        # The chain that starts at t = n_prompt + s − 2 has its k-th draft predict output[s + k].
        t = n_prompt - 2 + torch.arange(length - n_prompt + 1, device=t_logits.device)
        out = []
        for k, logits in enumerate(steps):
            full = head.logits_to_full(logits[0])[:, :vocab_size].to(t_logits.device)
            valid = (t >= 0) & (t + k + 1 < length)
            rows = t.clamp(0, length - 1)
            out.append((full[rows], t_logits[(t + k + 1).clamp(0, length - 1)], valid))
        return out


@register(20, variant=True)
class SGLangEagle3(Eagle3):
    """An EAGLE-3 head in SGLang's layout (an SGLang export read back as a draft): the same
    draft type, in another directory layout."""

    layout = "sglang"

    @staticmethod
    def detect(path) -> bool:
        """config.json with architectures [LlamaForCausalLMEagle3]."""
        return is_sglang_eagle3_dir(path)

    @staticmethod
    def detect_loaded(model) -> bool:
        """Never: a loaded head is the `Eagle3` type, whatever layout it was read from."""
        return False

    # loaded as what its config.json claims (a Llama causal LM), which its weights refuse
    load = staticmethod(Standalone.load)
    meta_model = staticmethod(Standalone.meta_model)


class Eagle3Drafter(StandaloneDrafter):
    """An EAGLE-3 head (drafts/eagle3/head.py) drafting from the target's features.

    Its cache holds one entry per committed position j < n whose target feature is known:
    (fc(feature_j), token j+1), at position j. The target gives the features of the tokens
    it verified, so after each round the accepted positions become `pending` pairs
    (fc(features) [m, H], tokens); the head's own γ−1 speculative entries (fed its pre-norm
    outputs) are always dropped. The prompt's first generated token comes from the
    target's prefill, as in EAGLE.
    """

    target_first_token = True  # the target prefills the whole prompt and samples token 1

    def __init__(self, head, vocab_size: int, device: torch.device):
        super().__init__(head, vocab_size, device)
        self.head = head

    def capture(self, target) -> FeatureCapture:
        """The head drafts from the features entering its aux layers of the target."""
        return FeatureCapture(target, self.head.aux_layers)

    def admit(self, prompts: Sequence[Sequence[int]], features) -> None:
        """prompts: prompt + first token; features: per row [len(prompt), F] (positions 0..)."""
        hidden = [self._fc(f) for f in features]
        self.stream.admit([p[1:-1] for p in prompts], hidden=[h[:-1] for h in hidden])
        self.pending += [(h[-1:], [p[-1]]) for h, p in zip(hidden, prompts, strict=True)]

    def _first_inputs(self) -> tuple[Tensor, Tensor, dict]:
        tokens, valid = left_pad([t for _, t in self.pending], self.device)
        hidden = left_pad_rows([h for h, _ in self.pending], valid)
        return tokens, valid, {"hidden_states": hidden}

    def _next_inputs(self) -> dict:
        return {"hidden_states": self.stream.output.hidden_states[:, -1:]}

    def _hidden_inputs(self) -> dict:
        return {}  # the head's output always carries its hidden states

    def _last_hidden(self) -> Tensor:
        """The head's output hidden state at the last position [B, H]."""
        return self.stream.output.hidden_states[:, -1]

    def commit(self, gamma: int, n_accepted: Tensor, host: list, features) -> None:
        """features [B, γ+1, F]: the target's, for [pending token, d_1..d_γ]."""
        hidden = self._fc(features)
        if gamma == 0:  # a target-only round: (feature of the pending token, new token)
            for i, (_, next_i) in enumerate(host):
                h, t = self.pending[i]
                self.pending[i] = (torch.cat([h, hidden[i, :1]]), list(t) + [next_i])
            return
        self.stream.drop_last(torch.full_like(n_accepted, gamma - 1))
        for i, (n_i, next_i, *drafts_i) in enumerate(host):
            self.pending[i] = (hidden[i, : n_i + 1], drafts_i[:n_i] + [next_i])

    def _fc(self, features: Tensor) -> Tensor:
        """Project target features (in the target's dtype, e.g. bf16) in the head's dtype."""
        return self.head.fc(features.to(self.head.fc.weight.dtype))


def new_eagle3_head(target, recipe_draft, train_data, vocab_size: int) -> Eagle3Head:
    """A fresh head for `target`, with its draft vocabulary built from `train_data`."""
    d = recipe_draft
    head = Eagle3Head.from_target(
        target,
        draft_vocab_size=d.vocab_size or vocab_size,
        aux_layers=d.aux_layers,
        intermediate_size=d.intermediate_size,
        norm_before_residual=d.norm_before_residual,
        vocab_size=vocab_size,
    )
    if head.draft_vocab_size < vocab_size:
        d2t, t2d = build_vocab_map(token_counts(train_data, vocab_size), head.draft_vocab_size)
        head.set_vocab_map(d2t, t2d, target.get_output_embeddings().weight[:vocab_size])
    return head
