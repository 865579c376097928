"""The parallel draft type: a standalone causal LM that proposes a whole block in one forward.

PARD's scheme (docs/parallel.md). The draft is a standalone causal LM with one extra token, the
mask token, whose embedding is learned (config.json's `pard_token` holds its id: the field
vLLM's parallel drafting reads). A round feeds the tokens committed since the last round
followed by γ − 1 mask tokens; the output at the last committed token is d_1 and the output at
the j-th mask is d_{j+1}, so the γ drafts come from one forward instead of γ.

Training (`depths`): K aligned depths from one forward of the draft on K copies of the
sequence. Copy 0 is the sequence itself (plain causal attention: depth 0 is the standalone
draft's next-token prediction); copy k ≥ 1 holds mask tokens, and its slot t (at position
t + k) sees the real tokens up to t and the masks of copies 1..k at slot t, which is exactly
what the draft sees at inference when t is the last committed token of a round and the
block has k masks so far. Depth k at anchor t predicts token t + k + 1 and is compared with
the target's prediction at t + k, so every loss of the library applies per depth and
`losses.multi_depth_loss` weights the depths (`loss.depth_weighting`). Every anchor trains
every depth (PARD's conditional drop-token sampling of anchors is not implemented).

The drafter proposes the block with one forward on its own KV cache; the γ − 1 mask entries
are dropped after verification and the accepted drafts become the next round's pending tokens
(as an EAGLE-3 head's do). Each position's token is drawn from that position's distribution,
which is what verification receives, so speculative sampling stays lossless.

Exported (`write_parallel_lm`) as the standalone draft's causal-LM directory with `pard_token`
in its config.json, for vLLM's parallel drafting (formats vllm and hf; not SGLang).
"""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from specdistill.drafts.acceptance_head import align_hidden, save_attached_head
from specdistill.drafts.align import target_mask
from specdistill.drafts.confidence import acceptance_head, predicted_acceptance
from specdistill.drafts.export import ExportError, Exports, Options, Plan
from specdistill.drafts.registry import register
from specdistill.drafts.standalone import (
    ReducedStandalone,
    Standalone,
    StandaloneDrafter,
    load_or_init,
    reduced_head,
)
from specdistill.drafts.standalone.export import (
    STANDALONE_TOKENS,
    read_causal_lm,
    write_causal_lm,
)
from specdistill.drafts.standalone.reduced_vocab import (
    ReducedHead,
    add_input_row,
    compared_ids,
    is_reduced,
    is_reduced_dir,
    output_columns,
)
from specdistill.drafts.types import Capabilities, Depths, DraftControl, Proposal
from specdistill.errors import UserError
from specdistill.losses import VocabTarget
from specdistill.models import hub
from specdistill.models.kv_cache import left_pad

MASK_FIELD = "pard_token"  # config.json's mask token id; vLLM's parallel drafting reads it
DEPTHS_FIELD = "parallel_depths"  # config.json: the block length K the draft was trained for


def mask_token(model) -> int | None:
    """The mask token id of a loaded draft (None: not a parallel draft)."""
    return getattr(getattr(model, "config", None), MASK_FIELD, None)


def add_mask_token(model) -> int:
    """Give a causal LM a mask token (one more input embedding row, initialised to the mean of
    the others; one more output row too unless the head is a reduced one) unless it has one;
    -> its id."""
    existing = mask_token(model)
    if existing is not None:
        return existing
    if is_reduced(model):  # its K-row output head stays as it is
        rows = add_input_row(model)
    else:
        rows = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(rows + 1, mean_resizing=True)
    setattr(model.config, MASK_FIELD, rows)
    return rows


def block_inputs(
    ids: Tensor, attention_mask: Tensor, mask_id: int, depths: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """K copies of a right-padded batch for one forward: (input ids [B, K·T], position ids
    [B, K·T], additive attention mask [B, 1, K·T, K·T]).

    Copy 0 is the batch with causal attention. Copy k ≥ 1 is T mask tokens; its slot t has
    position pos(t) + k and sees the valid tokens of copy 0 up to slot t and slot t of copies
    1..k. Every query sees itself, so no row of the mask is empty.
    """
    b, length = ids.shape
    device = ids.device
    valid = attention_mask.bool()
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    copy = torch.arange(depths, device=device).repeat_interleave(length)
    slot = torch.arange(length, device=device).repeat(depths)
    qc, kc, qs, ks = copy[:, None], copy[None, :], slot[:, None], slot[None, :]
    allowed = ((kc == 0) & (ks <= qs)) | ((kc >= 1) & (kc <= qc) & (ks == qs))
    seen = (allowed[None] & valid.repeat(1, depths)[:, None, :]) | torch.eye(
        depths * length, dtype=torch.bool, device=device
    )
    additive = torch.zeros(b, 1, *seen.shape[1:], dtype=dtype, device=device)
    additive.masked_fill_(~seen[:, None], torch.finfo(dtype).min)
    masks = torch.full((b, (depths - 1) * length), mask_id, dtype=ids.dtype, device=device)
    positions = torch.cat([pos + k for k in range(depths)], dim=1)
    return torch.cat([ids, masks], dim=1), positions, additive


def block_logits(
    model,
    ids: Tensor,
    attention_mask: Tensor,
    mask_id: int,
    depths: int,
    vocab_size: int,
    *,
    reduced: bool = False,
) -> list[Tensor]:
    """The draft's logits of every depth at every anchor, from one forward: K tensors
    [B, T, vocab_size] (`reduced`: a reduced head's K columns, [B, T, K]); depth k at slot t
    predicts token t + k + 1 from tokens ≤ t."""
    length = ids.shape[1]
    inputs, positions, mask = block_inputs(ids, attention_mask, mask_id, depths, model.dtype)
    extra = {"full_vocab": False} if reduced else {}
    out = model(input_ids=inputs, attention_mask=mask, position_ids=positions, **extra)
    logits = out.logits if reduced else out.logits[..., :vocab_size]
    return list(logits.split(length, dim=1))


def shifted_depths(blocks: list[Tensor], t_logits: Tensor, base_mask: Tensor) -> Depths:
    """Align K depths with the target: draft depth k at anchor t (t < T − 1) against the
    target's logits at t + k, valid where token t + k + 1 is a training target (`base_mask`
    [B, T − 1] is depth 0's mask, from drafts/align.py)."""
    length = t_logits.shape[1]
    anchors = torch.arange(length - 1, device=t_logits.device)
    d_out, t_out, m_out = [], [], []
    for k, logits in enumerate(blocks):
        index = (anchors + k).clamp_max(length - 2)
        inside = (anchors + k <= length - 2).to(base_mask.device)
        d_out.append(logits[:, :-1])
        t_out.append(t_logits[:, index])
        m_out.append(base_mask[:, index.to(base_mask.device)] & inside)
    return d_out, t_out, m_out


VLLM_HINT = (
    "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": {tokens}, "method": "draft_model", '
    '"parallel_drafting": true}}\''
)


def write_parallel_lm(model: nn.Module, options: Options) -> Plan:
    """The export of a parallel draft (drafts/export.py): the standalone draft's causal-LM
    directory, whose config.json keeps `pard_token` (the mask token id that vLLM's parallel
    drafting, `"parallel_drafting": true` with `"method": "draft_model"`, reads from the
    draft's config); the block length is --speculative-tokens, else the depths it was
    trained with. Not an SGLang format."""
    if mask_token(model) is None:
        raise ExportError("a parallel draft's config.json must name its mask token (pard_token)")
    plan = write_causal_lm(model, options)
    trained = getattr(model.config, DEPTHS_FIELD, None) or STANDALONE_TOKENS
    return Plan(plan.write, plan.verifier, options.speculative_tokens or trained)


@register(40)
@dataclass(frozen=True)
class Parallel:
    """The parallel draft type (a `drafts.types.DraftType`): `vocab_size` logit columns
    compared with the target, `steps` depths trained (K: the block's length), `mask_id` the
    draft's mask token."""

    vocab_size: int
    steps: int
    mask_id: int

    name = "parallel"
    d2t = None
    feature_layers = None  # reads the target's logits only
    capabilities = Capabilities(
        lora=False,
        chunked_loss=False,
        sparse_targets=False,
        # a block is proposed in one forward: the sequential chains do not describe it
        accepted_length=False,
        formats=("vllm", "hf"),  # vLLM's parallel drafting loads a causal LM with `pard_token`
        export_as="parallel_lm",
        vllm_speculation={"method": "draft_model", "parallel_drafting": True},
        refusals={
            "lora": "draft.lora with draft.type=parallel: the mask token's embedding must "
            "train; set draft.lora.r=0 (full fine-tuning)",
            "chunked_loss": "loss.chunk_size is not supported for draft.type=parallel (its "
            "depths come from one forward over the block's copies): set loss.chunk_size=null",
            "sparse_targets": "target.cache holds the target's top-N at each position for a "
            "standalone draft; a parallel draft's depths compare the target at shifted "
            "positions: unset target.cache",
        },
    )
    # its export (drafts/export.py): the causal-LM directory with its mask token
    exports = Exports(
        writers={"vllm": write_parallel_lm, "hf": write_parallel_lm},
        readers={"vllm": read_causal_lm, "hf": read_causal_lm},
        hints={"vllm": VLLM_HINT, "hf": VLLM_HINT},
    )
    layout = "hf"  # a saved parallel draft is a plain HF directory (with `pard_token`)

    @staticmethod
    def detect(path) -> bool:
        """A Hugging Face model directory whose config.json names a mask token (`pard_token`)."""
        config = Path(path) / "config.json"
        return config.is_file() and json.loads(config.read_text()).get(MASK_FIELD) is not None

    @staticmethod
    def detect_loaded(model) -> bool:
        """A causal LM whose config names a mask token."""
        return mask_token(model) is not None

    # saved as a causal-LM directory, loaded and sized as one
    load = staticmethod(Standalone.load)
    meta_model = staticmethod(Standalone.meta_model)

    @classmethod
    def planned(cls, cfg):
        """`ReducedParallel` for a `draft` section with `draft.vocab_size`, else this type."""
        return ReducedParallel if cfg.vocab_size is not None else cls

    @classmethod
    def build(cls, cfg, target, tokenizer, train_data, *, print=print):
        """(draft LM with a mask token, its type) for a recipe's `draft` section: the causal
        LM `cfg.model` (a standalone draft, or a parallel one to continue) or the target's
        layers (target-layers:...), as the standalone type loads it (`load_or_init`), given
        a mask token when it has none; with `cfg.vocab_size`, or when it has one already, its
        output head reduced to V_d as a standalone draft's (`ReducedParallel`); trained in
        full."""
        if cfg.lora.r > 0:
            raise UserError(cls.capabilities.refusals["lora"])
        draft = load_or_init(cfg, target, tokenizer)
        # a reduced head's rows are V_d: its ids are checked by `ReducedStandalone.reduce`
        full_head = None if is_reduced(draft) else draft
        vocab_size = min(
            hub.shared_vocab_size(target, full_head, tokenizer), rows_before_mask(draft)
        )
        mask_id = add_mask_token(draft)
        setattr(draft.config, DEPTHS_FIELD, cfg.parallel_depths)
        print(f"parallel draft: mask token {mask_id}, {cfg.parallel_depths} depths per anchor")
        if cfg.vocab_size is None and not is_reduced(draft):
            return draft, cls(vocab_size, cfg.parallel_depths, mask_id)
        draft, _ = ReducedStandalone.reduce(draft, cfg, target, tokenizer, train_data)
        print(
            f"parallel draft: output vocabulary V_d of {draft.config.draft_vocab_size} of the "
            f"target's {vocab_size} tokens"
        )
        return draft, ReducedParallel(vocab_size, cfg.parallel_depths, mask_id, draft.lm_head)

    def count_mask(self, batch: dict) -> Tensor:
        """The positions a step's loss is normalised by (depth 0's mask: the anchors)."""
        return target_mask(batch)

    def depths(self, draft, target, batch: dict) -> Depths:
        """Every depth's logits [B, T−1, V] against the target's [B, T−1, V]; a reduced head's
        K columns [B, T−1, K] instead (`ReducedParallel`: the type carries its `d2t`)."""
        ids, attention = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            t_logits = target(input_ids=ids, attention_mask=attention).logits[
                ..., : self.vocab_size
            ]
        reduced = self.d2t is not None
        blocks = block_logits(
            draft, ids, attention, self.mask_id, self.steps, self.vocab_size, reduced=reduced
        )
        return shifted_depths(blocks, t_logits, target_mask(batch))

    def stored_depths(self, draft, batch: dict, target: VocabTarget, features=None) -> Depths:
        """`depths` with the target's log-probabilities over the K columns stored (a
        `losses.VocabTarget` [B, T−1, K], `ReducedParallel`): no target forward."""
        ids, attention = batch["input_ids"], batch["attention_mask"]
        blocks = block_logits(
            draft, ids, attention, self.mask_id, self.steps, self.vocab_size, reduced=True
        )
        # shifted_depths takes the target at every position: the last predicts nothing
        logp = nn.functional.pad(target.logp, (0, 0, 0, 1))
        drafts, targets, masks = shifted_depths(blocks, logp, target_mask(batch))
        return drafts, [VocabTarget(t) for t in targets], masks

    def draft_ids(self) -> Tensor:
        """The target id of each compared column (a target cache's column order)."""
        return compared_ids(self.d2t, self.vocab_size)

    def chains(self, draft, target, batch: dict, starts: list[int], **sampling):
        """Not for this type: a parallel draft proposes its block in one forward, so the
        accepted-length objective's sequential chains do not describe how it drafts."""
        raise UserError(
            "loss tau (the draft's own chains) is implemented for standalone drafts and "
            "EAGLE-3 heads; "
            "for draft.type=parallel use a per-token loss (e.g. lk_lambda), weighted per depth"
        )

    def head_hidden(self, captured: list[Tensor], draft_logits: list[Tensor]) -> list[Tensor]:
        """The block forward is recorded once, [B, K·T, H]: its K copies, aligned like the
        depths' logits."""
        whole = captured[-1]
        copies = whole.split(whole.shape[1] // self.steps, dim=1)
        return align_hidden(list(copies), draft_logits)

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        setattr(draft.config, DEPTHS_FIELD, self.steps)  # the export's default block length
        draft.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        save_attached_head(draft, out)

    # ------------------------------------------------------------------ a loaded draft
    per_depth_alpha = True  # depth k of a block is predicted through k mask tokens
    own_tokenizer = True  # ships its own tokenizer, which must match the target's

    @staticmethod
    def vocab_size_of(model) -> int:
        """Logit columns the draft produces that are tokens (the mask token's row excluded)."""
        return rows_before_mask(model)

    @staticmethod
    def drafter(model, vocab_size: int, device: torch.device) -> "ParallelDrafter":
        """The engine's drafter (eval/engine.py) for a loaded parallel draft."""
        return ParallelDrafter(model, vocab_size, device)

    @staticmethod
    def path_logits(target, model, ids: Tensor, n_prompt: int, depth: int, vocab_size: int):
        """Teacher-forced logits along ids [1, T] = prompt + output, for the offline α.

        `depth` triples (draft logits [S, V], target logits [S, V], mask [S]), S = T −
        n_prompt + 1: row s of depth k is the k-th draft of a round that starts at generated
        position s (its anchor is token n_prompt + s − 1); masked where the text runs out.
        """
        length = ids.shape[1]
        t_logits = target(input_ids=ids).logits[0, :, :vocab_size]
        ones = torch.ones_like(ids, device=model.device)
        blocks = block_logits(
            model, ids.to(model.device), ones, mask_token(model), depth, vocab_size
        )
        anchors = torch.arange(n_prompt - 1, length, device=t_logits.device)
        out = []
        for k, logits in enumerate(blocks):
            rows = logits[0].to(t_logits.device)[anchors]
            out.append((rows, t_logits[(anchors + k).clamp_max(length - 1)], anchors + k < length))
        return out


@register(30, variant=True)
@dataclass(frozen=True)
class ReducedParallel(Parallel):
    """A parallel draft over V_d (FR-Spec, as `drafts.standalone.ReducedStandalone`): its
    output head keeps K rows with the d2t / t2d map; training compares the K columns of every
    depth with the target (`Parallel.depths` with `d2t`), and its forward, which the drafter
    and the offline α read, returns full-vocabulary logits with −inf outside V_d (q = 0 there:
    lossless). Its `name` is "parallel"; exported as hf only."""

    head: ReducedHead = field(compare=False, repr=False)

    @property
    def d2t(self) -> Tensor:
        """The draft's d2t map: draft id i is target id i + d2t[i]."""
        return self.head.d2t

    capabilities = replace(
        Parallel.capabilities,
        vocab_targets=True,  # target.cache over its V_d columns (`stored_depths`)
        formats=("hf",),
        vllm_speculation={},
        format_note=(
            "a parallel draft with a reduced output vocabulary (draft.vocab_size) is not a "
            "draft model vLLM loads; export it as hf (specdistill serve / speculate load that "
            "directory)"
        ),
    )

    @staticmethod
    def detect(path) -> bool:
        """A parallel draft's directory whose config.json says a reduced head's model_type."""
        return Parallel.detect(path) and is_reduced_dir(path)

    @staticmethod
    def detect_loaded(model) -> bool:
        """A parallel draft whose output head is reduced (`is_reduced`)."""
        return mask_token(model) is not None and is_reduced(model)

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        """`Parallel.save`, after checking the map the draft carries (`check_vocab_map`)."""
        reduced_head(draft).check(f"the draft saved to {out}")
        super().save(draft, out, tokenizer, verifier)


def rows_before_mask(model) -> int:
    """The logit columns that are tokens: all of them, or those before the mask token."""
    rows = output_columns(model)
    mask_id = mask_token(model)
    return rows if mask_id is None else min(rows, mask_id)


class ParallelDrafter(StandaloneDrafter):
    """A parallel draft on its own KV cache: one forward per round proposes the whole block.

    Its cache holds every committed token but the `pending` ones of each row (the tokens
    committed in the last round). A round appends the pending tokens and γ − 1 mask tokens;
    `commit` drops the masks, so the accepted drafts and the new token are pending next.
    """

    def __init__(self, model, vocab_size: int, device: torch.device):
        super().__init__(model, vocab_size, device)
        self.mask_id = mask_token(model)
        if self.mask_id is None:
            raise ValueError("a parallel drafter needs a draft with a mask token (pard_token)")
        self.masks = 0  # mask entries the last proposal appended to the cache

    def propose(self, gamma: int, sample, control: DraftControl | None = None) -> Proposal:
        """Up to γ drafts per row from one forward (`drafts.types.Proposal`). `sample` draws
        each position's token from its logits; with a `control`, each position's predicted
        acceptance may end the block early (the forward has been paid for anyway)."""
        tokens, valid = left_pad(self.pending, self.device)
        rows = tokens.shape[0]
        masks = torch.full((rows, gamma - 1), self.mask_id, dtype=tokens.dtype, device=self.device)
        tokens = torch.cat([tokens, masks], dim=1)
        valid = torch.cat([valid, torch.ones_like(masks, dtype=torch.bool)], dim=1)
        model = self.stream.model
        head = control is not None and acceptance_head(model) is not None
        logits = self.stream.forward(tokens, valid, keep=gamma, hidden=head)
        self.masks = gamma - 1
        drafted, q, confidence = [], [], []
        for step in range(gamma):
            token, probs = sample(logits[:, step])
            drafted.append(token)
            q.append(probs)
            if control is not None:
                hidden = self.stream.hidden[:, step] if head else None
                confidence.append(
                    predicted_acceptance(model, logits[:, step], token, probs, hidden)
                )
                if not control.keep_drafting(step + 1, confidence[-1]):
                    break
        return Proposal(
            torch.stack(drafted, dim=1), q, torch.stack(confidence, dim=1) if confidence else None
        )

    def commit(self, gamma: int, n_accepted: Tensor, host: list, features=None) -> None:
        """After verification: host[i] = [n_i, next_i, *drafts_i]."""
        if gamma == 0:  # a target-only round: the new token joins the pending ones
            for i, (_, next_i) in enumerate(host):
                self.pending[i] = list(self.pending[i]) + [next_i]
            return
        self.stream.drop_last(torch.full_like(n_accepted, self.masks))
        self.masks = 0
        for i, (n_i, next_i, *drafts_i) in enumerate(host):
            self.pending[i] = drafts_i[:n_i] + [next_i]
