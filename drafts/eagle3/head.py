"""EAGLE-3 draft head (docs/theory.md §4): fused target features -> one decoder layer -> V_d logits.

    features = concat(target hidden states entering aux layers l_low, l_mid, l_high)  [.., 3·H_t]
    h        = fc(features)                                                         [.., H]
    layer 0:  x = concat(input_layernorm(embed(next token)), hidden_norm(h))        [.., 2H]
              r = h (or hidden_norm(h) with norm_before_residual)
              r = r + o_proj(attention(q, k, v from x));  r = r + mlp(post_attention_layernorm(r))
    out      = r (pre-norm, the next step's h);  logits = lm_head(norm(r))          [.., V_d]

Position t of the head holds (feature of target position t, embedding of token t+1) and
predicts token t+2. Drafting a chain feeds the head's own pre-norm output back as the next
step's h. Training-time test (TTT) unrolls that chain K steps deep for every position at
once: the step-k entry of the chain that starts at t sits at position t+k and attends to the
step-0 entries at positions <= t and to its own chain's entries of steps 1..k, exactly what
it sees when drafting (`unroll`). The embedding is the target's, frozen.

The module's parameter names are those of the `speculators` Eagle-3 format that vLLM loads
(docs/theory.md §5), so a checkpoint is written by `save_pretrained` without renaming.
d2t / t2d map the draft vocabulary V_d into the target's V: target_id = i + d2t[i];
t2d[v] is True for the V_d target ids. Every load and save checks the map (`check_vocab_map`).

Modules: this one holds the head's layers, its drafting forward and its training-time test
(`unroll`, `align_depths`); drafts/vocab_map.py the vocabulary map, drafts/eagle3/features.py
the target's feature capture, drafts/eagle3/checkpoint.py the on-disk layout. Their public names
are importable from here too.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specdistill.drafts.eagle3 import checkpoint as eagle3_format
from specdistill.drafts.eagle3.checkpoint import (
    DEFAULT_SPECULATIVE_TOKENS,
    SGLANG_ARCH,
    SPECULATORS_VERSION,
    is_eagle3_dir,
    is_sglang_eagle3_dir,
    read_config,
)
from specdistill.drafts.eagle3.features import (
    FeatureCapture,
    decoder_layers,
    default_aux_layers,
)
from specdistill.drafts.vocab_map import (
    VocabMapError,
    build_vocab_map,
    check_vocab_map,
    logits_to_target,
)
from specdistill.errors import UserError

__all__ = [
    "DEFAULT_SPECULATIVE_TOKENS",
    "SGLANG_ARCH",
    "SPECULATORS_VERSION",
    "Eagle3Attention",
    "Eagle3Head",
    "Eagle3Layer",
    "Eagle3Output",
    "FeatureCapture",
    "VocabMapError",
    "align_depths",
    "build_vocab_map",
    "check_vocab_map",
    "decoder_layers",
    "default_aux_layers",
    "is_eagle3_dir",
    "is_sglang_eagle3_dir",
    "read_config",
]


@dataclass
class Eagle3Output:
    logits: Tensor  # [B, keep, V_d], or [B, keep, V] with −inf outside V_d (full_vocab=True)
    hidden_states: Tensor  # [B, k, H] pre-norm outputs: the next step's input h


class Eagle3Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, bias = config.hidden_size, config.attention_bias
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(2 * h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, k, 2H] -> q [B, heads, k, d], k and v [B, heads, k, d] (kv heads repeated)."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def expand(self, t: Tensor) -> Tensor:
        return t.repeat_interleave(self.n_heads // self.n_kv, dim=1)

    def out(self, attended: Tensor) -> Tensor:
        b, _, n, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, n, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, config: LlamaConfig, norm_before_residual: bool):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.norm_before_residual = norm_before_residual

    def inputs(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(attention input [B, k, 2H], residual [B, k, H])."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, residual: Tensor, attn_out: Tensor) -> Tensor:
        residual = residual + attn_out
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head. `config` is the decoder layer's LlamaConfig (vocab_size = the
    target's V); the EAGLE fields are attributes and live in config.json beside it.

    `ttt_steps` is the training-time-test depth the head was trained at (None: unknown, e.g.
    a fresh head). It is saved as config.json's `ttt_steps` and is the default number of
    speculative tokens written into the config (`speculators_config`)."""

    is_eagle3 = True

    def __init__(
        self,
        config: LlamaConfig,
        *,
        draft_vocab_size: int,
        target_hidden_size: int,
        aux_layers: Sequence[int],
        norm_before_residual: bool = False,
        ttt_steps: int | None = None,
    ):
        super().__init__()
        config.num_hidden_layers = 1
        self.config = config
        self.draft_vocab_size = draft_vocab_size
        self.target_hidden_size = target_hidden_size
        self.aux_layers = list(aux_layers)
        self.norm_before_residual = norm_before_residual
        self.ttt_steps = ttt_steps
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(self.aux_layers) * target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config, norm_before_residual)])
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        # Placeholder map, the lowest V_d ids, until `set_vocab_map` (or a loaded state dict).
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(
        cls,
        target,
        *,
        draft_vocab_size: int | None = None,
        aux_layers: Sequence[int] | None = None,
        intermediate_size: int | None = None,
        norm_before_residual: bool = False,
        vocab_size: int | None = None,
    ) -> "Eagle3Head":
        """A fresh head for `target`: its attention geometry, RoPE and (frozen) embedding."""
        tc = target.config
        n_layers = tc.num_hidden_layers
        embed = target.get_input_embeddings().weight
        vocab = vocab_size or embed.shape[0]
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=tc.hidden_size,
            intermediate_size=intermediate_size or tc.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            max_position_embeddings=tc.max_position_embeddings,
            rms_norm_eps=tc.rms_norm_eps,
            rope_parameters=getattr(tc, "rope_parameters", None),
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
            pad_token_id=getattr(tc, "pad_token_id", None),
        )
        head = cls(
            config,
            draft_vocab_size=draft_vocab_size or vocab,
            target_hidden_size=tc.hidden_size,
            aux_layers=aux_layers or default_aux_layers(n_layers),
            norm_before_residual=norm_before_residual,
        )
        head.to(embed.dtype)
        with torch.no_grad():
            head.embed_tokens.weight.copy_(embed[:vocab])
            # Start from the target's own output head on V_d (a strong init for lm_head).
            out = target.get_output_embeddings().weight[:vocab]
            head.lm_head.weight.copy_(out[head.draft_ids()])
        return head

    def set_vocab_map(self, d2t: Tensor, t2d: Tensor, lm_head_source: Tensor | None = None):
        """Install a checked map; `lm_head_source` [V, H] re-initialises lm_head rows from it."""
        check_vocab_map(d2t, t2d, self.config.vocab_size, self.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if lm_head_source is not None:
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_source[self.draft_ids()])

    def draft_ids(self) -> Tensor:
        """Target id of every draft id: [V_d]."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ------------------------------------------------------------------ compute
    def _logits(self, hidden: Tensor, full_vocab: bool) -> Tensor:
        logits = self.lm_head(self.norm(hidden))
        return self.logits_to_full(logits) if full_vocab else logits

    def logits_to_full(self, logits: Tensor) -> Tensor:
        """[..., V_d] -> [..., V] with −inf outside V_d (q puts no mass there)."""
        return logits_to_target(logits, self.draft_ids(), self.config.vocab_size)

    def forward(
        self,
        input_ids: Tensor,
        hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache=None,
        logits_to_keep: int = 0,
        full_vocab: bool = True,
        use_cache: bool = True,
        *,
        features: Tensor | None = None,
        ttt_steps: int | None = None,
        next_ids=None,
    ) -> Eagle3Output | list[Tensor]:
        """One drafting forward with a KV cache (the engine's path), or with `ttt_steps`
        the training-time test: `unroll(features, input_ids, attention_mask, ttt_steps,
        next_ids)`.
        Training goes through forward so that DDP / FSDP wrappers see the call.

        input_ids [B, k]: the tokens after the positions of `hidden_states` [B, k, H]
        (already projected by fc, or the head's previous pre-norm outputs). attention_mask
        [B, L] bool over the cache after appending (True = valid key); position_ids [B, k].
        `cache`: a transformers DynamicCache (layer 0) or None (no cache: plain causal).
        full_vocab: logits over the target's V (−inf outside V_d) instead of V_d.
        """
        if ttt_steps is not None:
            return self.unroll(features, input_ids, attention_mask, ttt_steps, next_ids)
        b, n = input_ids.shape
        layer = self.layers[0]
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None].expand(b, -1)
        x, residual = layer.inputs(self.embed_tokens(input_ids), hidden_states)
        cos, sin = self.rotary_emb(x, position_ids)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        length = k.shape[2]
        keys_valid = (
            attention_mask.bool()
            if attention_mask is not None
            else torch.ones(b, length, dtype=torch.bool, device=x.device)
        )
        index = torch.arange(length, device=x.device)
        query_at = index[length - n :]
        allowed = (index[None, :] <= query_at[:, None])[None] & keys_valid[:, None, :]
        allowed = allowed | (index[None, :] == query_at[:, None])[None]  # padded queries: self
        attended = nn.functional.scaled_dot_product_attention(
            q,
            layer.self_attn.expand(k),
            layer.self_attn.expand(v),
            attn_mask=allowed[:, None],
        )
        hidden = layer.finish(residual, layer.self_attn.out(attended))
        keep = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return Eagle3Output(self._logits(keep, full_vocab), hidden)

    def unroll(
        self,
        features: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        steps: int,
        next_ids=None,
    ) -> list[Tensor]:
        """Training-time test: `steps` drafting steps for every position at once.

        features [B, T, n_aux·H_t] (target positions 0..T−1), input_ids [B, T], attention_mask
        [B, T] (right padding). Returns `steps` logits [B, T, V_d]; entry t of depth k is the
        chain that starts at position t, k steps in: it predicts token t+k+2 and was fed the
        tokens t+1..t+k+1 (teacher forcing), its own earlier outputs as h, and sits at
        position t+k. Entries whose inputs run past T are garbage; mask them (`depth_masks`).

        `next_ids(step, logits)`, when given, feeds steps ≥ 1 the head's own tokens instead:
        it gets the previous step's logits [B, T, V_d] and returns [B, T] target-vocabulary
        ids (the accepted-length objective's chains, drafts/eagle3/chains.py).
        """
        b, t = input_ids.shape
        layer, attn = self.layers[0], self.layers[0].self_attn
        keys_valid = (
            attention_mask.bool()
            if attention_mask is not None
            else torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        )
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        causal = causal[None, None] & keys_valid[:, None, None, :]  # [B, 1, T, T]
        scale = attn.head_dim**-0.5
        positions = torch.arange(t, device=input_ids.device)[None].expand(b, -1)
        hidden = self.fc(features)
        k0 = v0 = None
        chain_k, chain_v = [], []  # steps 1..k: one key / value per chain (diagonal)
        outputs = []
        for step in range(steps):
            if step == 0 or next_ids is None:
                ids = torch.nn.functional.pad(input_ids[:, step + 1 :], (0, step + 1))
            else:
                ids = next_ids(step, outputs[-1])
            x, residual = layer.inputs(self.embed_tokens(ids), hidden)
            cos, sin = self.rotary_emb(x, positions + step)
            q, k, v = attn.qkv(x, cos, sin)
            k, v = attn.expand(k), attn.expand(v)
            if step == 0:
                k0, v0 = k, v
                attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
            else:
                chain_k.append(k)
                chain_v.append(v)
                scores0 = (q @ k0.transpose(-1, -2)) * scale
                scores0 = scores0.masked_fill(~causal, float("-inf"))
                diag = torch.stack([(q * ck).sum(-1) for ck in chain_k], dim=-1) * scale
                probs = torch.cat([scores0, diag], dim=-1).float().softmax(-1).to(q.dtype)
                attended = probs[..., :t] @ v0 + sum(
                    probs[..., t + j, None] * cv for j, cv in enumerate(chain_v)
                )
            hidden = layer.finish(residual, attn.out(attended))
            outputs.append(self._logits(hidden, full_vocab=False))
        return outputs

    # ------------------------------------------------------------------ save / load
    def speculators_config(
        self, verifier: str | None = None, verifier_arch=None, speculative_tokens: int | None = None
    ) -> dict:
        """The speculators config.json (drafts/eagle3/checkpoint.py)."""
        return eagle3_format.speculators_config(self, verifier, verifier_arch, speculative_tokens)

    def save_pretrained(
        self,
        directory,
        *,
        verifier: str | None = None,
        verifier_arch=None,
        speculative_tokens: int | None = None,
    ):
        """config.json + model.safetensors in the speculators layout (docs/theory.md §5)."""
        eagle3_format.save_pretrained(
            self,
            directory,
            verifier=verifier,
            verifier_arch=verifier_arch,
            speculative_tokens=speculative_tokens,
        )

    @classmethod
    def from_pretrained(cls, directory, dtype: torch.dtype | None = None) -> "Eagle3Head":
        """Load a head saved by `save_pretrained` (or any speculators Eagle-3 checkpoint)."""
        return eagle3_format.from_pretrained(cls, directory, dtype)

    def load_checked(self, state: dict[str, Tensor], source: str) -> None:
        """Load a full state dict, all or nothing (`IncompleteDraftError` otherwise)."""
        eagle3_format.load_checked(self, state, source)


def align_depths(
    draft_logits: Sequence[Tensor], target_logits: Tensor, loss_mask: Tensor, attention_mask: Tensor
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Pair `unroll`'s K depths with the target: (drafts, targets, masks), views of one length.

    Depth k, chain t predicts token t+k+2: its target is the target's logits at position
    t+k+1 and it counts where token t+k+2 is a real, loss-masked token. Chains t < T−K−1
    are kept at every depth (so the K depths stack; the last K−1 shallow entries of each
    row are dropped, which avoids copying [B, T, V] target logits).
    """
    steps, t = len(draft_logits), target_logits.shape[1]
    length = t - steps - 1
    if length < 1:
        raise UserError(f"sequences of {t} tokens are too short for {steps} TTT steps")
    valid = loss_mask.bool() & attention_mask.bool()
    drafts = [d[:, :length] for d in draft_logits]
    targets = [target_logits[:, k + 1 : k + 1 + length] for k in range(steps)]
    masks = [valid[:, k + 2 : k + 2 + length] for k in range(steps)]
    return drafts, targets, masks
