"""The acceptance head: a small module on a draft's hidden state that predicts, at every
draft position, the probability that the target accepts the token the draft proposes there
(docs/theory.md §1, "The acceptance head").

Inputs, the same in training and in the engine:
- ``hidden [..., H]``: the draft's hidden state at the position, the input of its output
  head (after the final norm): for a causal LM what its ``lm_head`` reads (Hugging Face's
  ``hidden_states[-1]``), for an EAGLE-3 head ``norm(h)`` of its own output h, what its
  ``lm_head`` reads. `HeadInputs` records exactly that tensor during a forward.
- ``draft_logits [..., V]``: the draft's logits at the position (the distribution it
  proposes from); with ``draft_stats`` the head also reads their top-1 probability and
  entropy at temperature 1 (`draft_stats`). −inf columns (an EAGLE-3 head's logits over the
  target's vocabulary outside V_d) change neither.

    features = [hidden, top-1 probability, entropy]          (`head_features`)
    logit    = Linear(h, 1)(SiLU(Linear(H + 2, h)([RMSNorm(hidden), stats])))   (`score`)

The output is a logit per position; sigmoid(logit) is the predicted acceptance. The last
layer starts at zero weight and bias logit(prior), so an untrained head predicts `prior`
everywhere. The head runs in float32 on the device of its input.

Training: `head_loss` over a draft type's depths (hidden states recorded with `HeadInputs`
and aligned by `align_hidden`), or `chunked_head_loss` where the logits exist one chunk of
positions at a time; both against the label α of `losses.acceptance_head`.

On disk, beside the draft's own files (`save_acceptance_head`, `load_acceptance_head`):
``acceptance_head.safetensors`` (the head's tensors) and ``acceptance_head.json``
(``{"acceptance_head": {"version": 1, "hidden_size": H, "inner_size": h, ...}}``). A loaded
draft carries its head as the attribute ``acceptance_head`` (`attach_head`), which is not a
registered submodule: the draft's state_dict, parameters and save_pretrained stay the
draft's own, and export formats (vLLM, SGLang) never see the head.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn import functional as F

from specdistill.losses import SparseTarget
from specdistill.losses.acceptance_head import acceptance_head_loss, acceptance_label
from specdistill.models.weights import (
    IncompleteDraftError,
    check_state_file,
    read_safetensors,
)

WEIGHTS = "acceptance_head.safetensors"
CONFIG = "acceptance_head.json"
VERSION = 1
ATTRIBUTE = "acceptance_head"  # where a loaded draft carries its head
N_STATS = 2  # top-1 probability, entropy


@dataclass(frozen=True)
class AcceptanceHeadConfig:
    """The head's sizes and inputs, saved in acceptance_head.json.

    hidden_size: the draft's hidden size H. inner_size: the hidden layer's width h.
    draft_stats: whether the head also reads the draft's top-1 probability and entropy.
    prior: the acceptance an untrained head predicts. temperature: the serving temperature
    its labels were taken at (None: not recorded)."""

    hidden_size: int
    inner_size: int = 256
    draft_stats: bool = True
    prior: float = 0.6
    temperature: float | None = None

    def __post_init__(self):
        if self.hidden_size < 1 or self.inner_size < 1:
            raise ValueError(
                f"acceptance head sizes must be >= 1, got hidden_size={self.hidden_size}, "
                f"inner_size={self.inner_size}"
            )
        if not 0 < self.prior < 1:
            raise ValueError(f"acceptance head prior must be in (0, 1), got {self.prior}")

    @classmethod
    def for_draft(cls, model, **fields) -> "AcceptanceHeadConfig":
        """A config for the draft `model` (a causal LM or an EAGLE-3 head): its hidden size,
        an inner width of min(H, 256) unless given."""
        hidden = model.config.hidden_size
        fields.setdefault("inner_size", min(hidden, 256))
        return cls(hidden_size=hidden, **fields)


def draft_stats(draft_logits: Tensor, *, rows: int = 1024) -> Tensor:
    """[..., V] -> [..., 2]: the draft's top-1 probability and its entropy (nats), both at
    temperature 1, in float32; computed `rows` positions at a time, so that no float32
    copy of the whole [..., V] logits is made."""
    flat = draft_logits.reshape(-1, draft_logits.shape[-1])
    chunks = [_stats(flat[i : i + rows]) for i in range(0, flat.shape[0], rows)]
    stats = torch.cat(chunks) if chunks else flat.new_zeros(0, N_STATS, dtype=torch.float32)
    return stats.reshape(*draft_logits.shape[:-1], N_STATS)


def _stats(logits: Tensor) -> Tensor:
    z = logits.float()
    lse = z.logsumexp(-1, keepdim=True)
    p = (z - lse).exp()
    entropy = lse[:, 0] - (p * z.masked_fill(p == 0, 0.0)).sum(-1)  # −Σ p log p, 0·(−inf) = 0
    return torch.stack([p.amax(-1), entropy], dim=-1)


def head_features(hidden: Tensor, draft_logits: Tensor | None = None, *, stats: bool = True):
    """The head's input [..., H + 2] (float32): hidden, then `draft_stats(draft_logits)`; just
    the hidden state [..., H] with ``stats=False`` (draft_logits is then not read)."""
    if not stats:
        return hidden.float()
    if draft_logits is None:
        raise ValueError(
            "this acceptance head reads the draft's top-1 probability and entropy "
            "(draft_stats): pass the draft's logits at the same positions as the hidden state"
        )
    if draft_logits.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"hidden {list(hidden.shape)} and draft_logits {list(draft_logits.shape)} must "
            "agree on all but the last dim"
        )
    return torch.cat([hidden.float(), draft_stats(draft_logits)], dim=-1)


class AcceptanceHead(nn.Module):
    """Predicted acceptance of the draft's proposal at each position, as a logit.

    ``head(hidden, draft_logits) -> [..., 1]`` is the one call of the trainer and the engine
    (sigmoid of it is the probability; `predict` gives it as [...]). With ``stop_gradient``
    (the default) the inputs are detached, so training the head never changes the draft."""

    def __init__(self, config: AcceptanceHeadConfig):
        super().__init__()
        self.config = config
        h, inner = config.hidden_size, config.inner_size
        self.norm = nn.RMSNorm(h, eps=1e-6)
        self.fc1 = nn.Linear(h + (N_STATS if config.draft_stats else 0), inner)
        self.act = nn.SiLU()
        self.fc2 = nn.Linear(inner, 1)
        with torch.no_grad():
            self.fc2.weight.zero_()
            self.fc2.bias.fill_(math.log(config.prior / (1 - config.prior)))

    def forward(
        self, hidden: Tensor, draft_logits: Tensor | None = None, *, stop_gradient: bool = True
    ) -> Tensor:
        """hidden [..., H], draft_logits [..., V] (needed with draft_stats) -> logits [..., 1]."""
        if stop_gradient:
            hidden = hidden.detach()
            draft_logits = None if draft_logits is None else draft_logits.detach()
        with torch.set_grad_enabled(torch.is_grad_enabled() and not stop_gradient):
            features = head_features(hidden, draft_logits, stats=self.config.draft_stats)
        return self.score(features)

    def score(self, features: Tensor) -> Tensor:
        """`head_features`' output [..., H (+2)] -> logits [..., 1]."""
        if features.device != self.fc1.weight.device:  # not a registered submodule of its draft
            self.to(features.device)
        weight, h = self.fc1.weight, self.config.hidden_size
        if features.shape[-1] != self.fc1.in_features:
            raise ValueError(
                f"acceptance head features have {features.shape[-1]} columns, the head takes "
                f"{self.fc1.in_features} (hidden size {h}"
                + (f" + {N_STATS} draft stats)" if self.config.draft_stats else ")")
            )
        x = features.to(weight.dtype)
        x = torch.cat([self.norm(x[..., :h]), x[..., h:]], dim=-1)
        return self.fc2(self.act(self.fc1(x)))

    @torch.no_grad()
    def predict(self, hidden: Tensor, draft_logits: Tensor | None = None) -> Tensor:
        """Predicted acceptance probabilities [...] (no gradient)."""
        return torch.sigmoid(self(hidden, draft_logits)).squeeze(-1)

    @torch.no_grad()
    def predict_rows(self, hidden: Tensor, draft_logits: Tensor) -> Tensor:
        """`predict` for one draft step of the engine: hidden [B, H], draft_logits [B, V] ->
        [B] float32, the same function in fewer tensor operations (the draft stats from one
        shifted exponential, the norm and the layers as functional calls), because it runs
        after every draft step."""
        fc1 = self.fc1
        if hidden.device != fc1.weight.device:
            self.to(hidden.device)
        x = F.rms_norm(hidden.float(), (self.config.hidden_size,), self.norm.weight, self.norm.eps)
        if self.config.draft_stats:
            z = draft_logits.float()
            shifted = z - z.amax(-1, keepdim=True)
            e = shifted.exp()
            total = e.sum(-1, keepdim=True)
            # top-1 probability 1/Σe; entropy log Σe − Σ e·(z − max) / Σe (`draft_stats`)
            mean_shift = torch.linalg.vecdot(e, shifted.clamp_min(-1e30))  # 0·(−inf) = 0
            stats = torch.cat([total.reciprocal(), total.log() - mean_shift[:, None] / total], -1)
            x = torch.cat([x, stats], dim=-1)
        inner = F.silu(F.linear(x, fc1.weight, fc1.bias))
        return torch.sigmoid(F.linear(inner, self.fc2.weight, self.fc2.bias))[:, 0]


# ----------------------------------------------------------------------------- hidden states


def output_head(model) -> nn.Module:
    """The draft's output head (``lm_head``), whose input is the head's hidden state."""
    get = getattr(model, "get_output_embeddings", None)
    module = get() if callable(get) else None
    return module if module is not None else model.lm_head


class HeadInputs:
    """Records the input of a draft's output head on every call inside the block:
    ``tensors`` is one [B, T, H] per call, in order (one per forward of a causal LM, one per
    depth of an EAGLE-3 head's training-time test)."""

    def __init__(self, model):
        self.module = output_head(model)
        self.tensors: list[Tensor] = []
        self._handle = None

    def _record(self, module, args, output) -> None:
        self.tensors.append(args[0])

    def __enter__(self) -> "HeadInputs":
        self._handle = self.module.register_forward_hook(self._record)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._handle = None


def align_hidden(captured: list[Tensor], draft_logits: list[Tensor]) -> list[Tensor]:
    """The recorded hidden states at the positions of each depth's draft logits: depth k
    keeps the first ``draft_logits[k].shape[1]`` positions of ``captured[-K + k]`` (the
    positions a draft type's `depths` keeps: a causal LM's drop the last one, an EAGLE-3
    head's the last K + 1). -> one [B, T_k, H] per depth."""
    steps = len(draft_logits)
    if len(captured) < steps:
        raise ValueError(
            f"{len(captured)} recorded hidden states for {steps} depths: record the draft's "
            "forward with HeadInputs around the draft type's depths()"
        )
    return [
        hidden[:, : logits.shape[1]]
        for hidden, logits in zip(captured[-steps:], draft_logits, strict=True)
    ]


class HeadLoss(NamedTuple):
    """`head_loss`'s result: the summed loss over every depth's valid positions and their
    count (divide once by the global count, like the draft's loss), and per depth the
    predicted acceptance (sigmoid, detached) and the label α, both [B, T_k] (for
    `eval.calibration`, with the depth's mask)."""

    loss_sum: Tensor
    n_valid: Tensor
    predicted: list[Tensor]
    labels: list[Tensor]


def head_loss(
    head: AcceptanceHead,
    hidden: Sequence[Tensor],
    draft_logits: Sequence[Tensor],
    target_logits: Sequence,
    masks: Sequence[Tensor | None],
    *,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
    stop_gradient: bool = True,
    labels: Sequence[Tensor] | None = None,
) -> HeadLoss:
    """The head's loss over a draft type's depths (`DraftType.depths`, the hidden states from
    `align_hidden`): per depth `head(hidden, draft_logits)` against `losses.acceptance_label`
    at the serving temperature and filters (`losses.acceptance_head_loss`). labels: those α
    per depth when the caller has them already (the draft's loss at the same temperature and
    filters computes them: `losses.multi_depth.depth_sums`), not computed again."""
    given = labels
    total, count, predicted, labels = None, None, [], []
    for k, (h, d, t, m) in enumerate(zip(hidden, draft_logits, target_logits, masks, strict=True)):
        if given is not None:
            label = given[k]
        else:
            label = acceptance_label(
                d, t, m, temperature=temperature, top_p=top_p, top_k=top_k, d2t=d2t
            )
        pred = head(h, d, stop_gradient=stop_gradient)
        loss_sum, n_valid = acceptance_head_loss(pred, None, None, m, label=label)
        total = loss_sum if total is None else total + loss_sum
        count = n_valid if count is None else count + n_valid
        predicted.append(torch.sigmoid(pred.detach()).squeeze(-1))
        labels.append(label)
    if total is None:
        raise ValueError("head_loss needs at least one depth")
    return HeadLoss(total, count, predicted, labels)


def chunked_head_loss(
    head: AcceptanceHead,
    draft_hidden: Tensor,
    draft_head_weight: Tensor,
    target_logits,
    mask: Tensor | None = None,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
) -> HeadLoss:
    """`head_loss` of one depth whose logits are never materialised whole (the trainer's
    chunked path, `losses.chunked_loss`): the draft's logits ``draft_hidden [..., H] @
    draft_head_weight.T`` and the target's, a tensor [..., V], a `losses.SparseTarget` or
    ``(target_hidden [..., H_t], target_head_weight [V, H_t])``, are formed `chunk_size`
    positions at a time. The head's inputs are detached (the draft gets no gradient)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = draft_hidden.shape[:-1]
    hidden = draft_hidden.detach().reshape(-1, draft_hidden.shape[-1])
    flat_mask = None if mask is None else mask.reshape(-1)
    total, count, predicted, labels = None, None, [], []
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        m = None if flat_mask is None else flat_mask[rows]
        with torch.no_grad():
            d = h @ draft_head_weight.detach().T
            t = _target_rows(target_logits, lead, rows)
        part = head_loss(
            head, [h], [d], [t], [m], temperature=temperature, top_p=top_p, top_k=top_k, d2t=d2t
        )
        total = part.loss_sum if total is None else total + part.loss_sum
        count = part.n_valid if count is None else count + part.n_valid
        predicted += part.predicted
        labels += part.labels
    if total is None:
        raise ValueError("chunked_head_loss needs at least one position")
    return HeadLoss(
        total, count, [torch.cat(predicted).reshape(lead)], [torch.cat(labels).reshape(lead)]
    )


def _target_rows(target, lead: torch.Size, rows: slice):
    """Rows `rows` of a target flattened over the leading dims `lead`."""
    if isinstance(target, tuple) and not isinstance(target, SparseTarget):  # (hidden, weight)
        t_hidden, t_weight = target
        return t_hidden.reshape(-1, t_hidden.shape[-1])[rows] @ t_weight.T
    if isinstance(target, Tensor):
        return target.reshape(-1, target.shape[-1])[rows]
    fields = [None if f is None else f.reshape(-1, *f.shape[len(lead) :])[rows] for f in target]
    return type(target)(*fields)  # a SparseTarget


# ----------------------------------------------------------------------------- a loaded draft


def attach_head(model, head: AcceptanceHead | None) -> None:
    """Set (or with None remove) ``model.acceptance_head`` without registering it as a
    submodule, so the draft's state_dict and save_pretrained stay the draft's."""
    if head is None:
        model.__dict__.pop(ATTRIBUTE, None)
    else:
        object.__setattr__(model, ATTRIBUTE, head)


def attached_head(model) -> AcceptanceHead | None:
    """The head a draft carries (`attach_head`), or None."""
    head = getattr(model, ATTRIBUTE, None)
    return head if isinstance(head, AcceptanceHead) else None


# ----------------------------------------------------------------------------- files


def has_acceptance_head(directory) -> bool:
    """Whether a draft directory holds a head (either of its two files)."""
    directory = Path(directory)
    return (directory / WEIGHTS).exists() or (directory / CONFIG).exists()


def save_acceptance_head(head: AcceptanceHead, directory) -> None:
    """Write acceptance_head.safetensors, then acceptance_head.json, into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
    entry = {"version": VERSION, **asdict(head.config)}
    (directory / CONFIG).write_text(json.dumps({ATTRIBUTE: entry}, indent=2) + "\n")


def save_attached_head(model, directory) -> None:
    """Beside a saved draft: its attached head's files, or none (files of an earlier head in
    `directory` are removed, so that a draft is never served with another draft's head)."""
    head = attached_head(model)
    if head is not None:
        save_acceptance_head(head, directory)
        return
    for name in (CONFIG, WEIGHTS):
        (Path(directory) / name).unlink(missing_ok=True)


def load_acceptance_head(directory, *, hidden_size: int | None = None) -> AcceptanceHead | None:
    """The head saved in a draft directory (float32, on the CPU), or None when the directory
    has neither of its files. One of the two files without the other, a config that cannot
    be read, a head for another hidden size or weights that do not match the config are an
    `IncompleteDraftError`, a weights file that cannot be read a `BrokenWeightsError`, each
    naming the file."""
    directory = Path(directory)
    weights, config_file = directory / WEIGHTS, directory / CONFIG
    if not weights.exists() and not config_file.exists():
        return None
    fix = f"save the draft with its head again, or delete both {CONFIG} and {WEIGHTS}"
    for present, absent in ((config_file, weights), (weights, config_file)):
        if present.exists() and not absent.is_file():
            raise IncompleteDraftError(f"{absent}: missing beside {present.name}: {fix}")
    config = read_config(config_file, fix)
    if hidden_size is not None and config.hidden_size != hidden_size:
        raise IncompleteDraftError(
            f"{config_file}: an acceptance head for hidden size {config.hidden_size}, the "
            f"draft's is {hidden_size}: {fix}"
        )
    head = AcceptanceHead(config)
    check_state_file(weights, head.state_dict(), advice=fix)
    head.load_state_dict(read_safetensors(weights))
    return head.eval()


def read_config(path: Path, fix: str) -> AcceptanceHeadConfig:
    """The `acceptance_head` entry of acceptance_head.json, checked."""
    try:
        entry = json.loads(path.read_text())[ATTRIBUTE]
        version = entry.pop("version")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise IncompleteDraftError(
            f"{path}: not an acceptance head config ({type(e).__name__}: {e}); expected "
            f'{{"{ATTRIBUTE}": {{"version": {VERSION}, "hidden_size": ...}}}}: {fix}'
        ) from None
    if version != VERSION:
        raise IncompleteDraftError(
            f"{path}: acceptance head version {version!r}, this specdistill reads version "
            f"{VERSION}: {fix}"
        )
    try:
        return AcceptanceHeadConfig(**entry)
    except (TypeError, ValueError) as e:
        raise IncompleteDraftError(f"{path}: {e}: {fix}") from None


def attach_saved_head(model, directory) -> AcceptanceHead | None:
    """Attach the head saved in a draft directory to the loaded draft `model` (checked against
    its hidden size); no head files: nothing is attached. Returns the head."""
    head = load_acceptance_head(directory, hidden_size=model.config.hidden_size)
    if head is not None:
        attach_head(model, head)
    return head
