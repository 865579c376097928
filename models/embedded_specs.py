"""The embedded models' specifications: their names (`EMBEDDED`), tokenizer families
(`CorpusSpec`), architectures and training budgets (`EmbeddedSpec`), and the spec as a
build record stores it (`record_spec`). models/embedded.py builds and caches them.
"""

import json
from dataclasses import asdict, dataclass

# Bump when a change to the embedded modules changes what a build produces: cached builds with
# another version are rebuilt.
BUILD_VERSION = 1
BUILD_RECORD = "specdistill_build.json"
PREFIX = "embedded:"

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class CorpusSpec:
    """The tokenizer and text of a model family; models of one family share its tokenizer."""

    name: str
    vocab_size: int
    train_files: int | None = None  # None: the whole train split; n: n files spread over it
    heldout_files: int | None = None
    text: str = "code"  # code: the stdlib sources; prose: their docstrings and help topics


@dataclass(frozen=True)
class EmbeddedSpec:
    """A Llama model pretrained from scratch with next-token loss on `corpus`."""

    corpus: CorpusSpec
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seq_len: int  # training block length (packed documents separated by EOS)
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    eval_blocks: int  # held-out blocks of `seq_len` scored for the build record
    seed: int = 0
    # torch intra-op threads while building; None: the free cores (specdistill/threads.py)
    threads: int | None = None
    # Progressive stacking (Gong et al. 2019, "Efficient Training of BERT by Progressively
    # Stacking"): train `grow_from_layers` layers for the first `grow_at_step` steps, then
    # repeat each layer num_layers / grow_from_layers times and train the rest at full depth.
    # A deep narrow target costs many layers per decoding step (what makes a draft cheap
    # next to it) but trains slowly from scratch; the shallow model learns fast and the
    # grown one starts from what it learnt. None: one stage at full depth.
    grow_from_layers: int | None = None
    grow_at_step: int = 0

    def __post_init__(self):
        if self.grow_from_layers is not None:
            if self.num_layers % self.grow_from_layers:
                raise ValueError(
                    f"num_layers {self.num_layers} is not a multiple of grow_from_layers "
                    f"{self.grow_from_layers}"
                )
            if not 0 < self.grow_at_step < self.steps:
                raise ValueError(f"grow_at_step must be in (0, steps={self.steps})")


CODE = CorpusSpec("code", vocab_size=4096)
PROSE = CorpusSpec("prose", vocab_size=2048, text="prose")
TINY = CorpusSpec("tiny", vocab_size=512, train_files=12, heldout_files=3)

EMBEDDED: dict[str, EmbeddedSpec] = {
    # Sizes and steps chosen for a build of minutes on a few CPU cores. With so little
    # compute, optimizer steps matter more than width: a 192-wide model on batches of 4
    # reached a lower held-out loss in the same time than a 256-wide one on 8.
    "code": EmbeddedSpec(
        CODE,
        hidden_size=192,
        num_layers=4,
        num_heads=4,
        intermediate_size=512,
        max_position_embeddings=1024,
        seq_len=512,
        batch_size=4,
        steps=450,
        lr=3e-3,
        warmup_steps=20,
        eval_blocks=48,
    ),
    "code-draft": EmbeddedSpec(
        CODE,
        hidden_size=128,
        num_layers=1,
        num_heads=2,
        intermediate_size=344,
        max_position_embeddings=1024,
        seq_len=512,
        batch_size=4,
        steps=120,
        lr=3e-3,
        warmup_steps=8,
        eval_blocks=48,
    ),
    # The default pair (recipes/code.yaml): a target deep enough that the one-layer draft
    # costs a small fraction of its decoding step on a CPU, as drafts do next to real
    # targets on GPUs (per-layer overhead, not width, sets a small model's decoding step on
    # a CPU). 20 layers grown from 4 (progressive stacking) reached a lower held-out loss
    # than 16 or 20 layers trained from scratch in the same time, and a lower one than
    # "code".
    "code-deep": EmbeddedSpec(
        CODE,
        hidden_size=128,
        num_layers=20,
        num_heads=4,
        intermediate_size=344,
        max_position_embeddings=1024,
        seq_len=256,
        batch_size=8,
        steps=600,
        lr=3e-3,
        warmup_steps=20,
        eval_blocks=96,
        grow_from_layers=4,
        grow_at_step=450,
    ),
    "code-deep-draft": EmbeddedSpec(
        CODE,
        hidden_size=128,
        num_layers=1,
        num_heads=2,
        intermediate_size=344,
        max_position_embeddings=1024,
        seq_len=256,
        batch_size=8,
        steps=400,
        lr=3e-3,
        warmup_steps=8,
        eval_blocks=96,
    ),
    # A second pair whose target never saw code: English documentation (data.stdlib_prose),
    # for comparisons that must not hold only on code (docs/quality.md).
    "prose": EmbeddedSpec(
        PROSE,
        hidden_size=160,
        num_layers=3,
        num_heads=4,
        intermediate_size=432,
        max_position_embeddings=512,
        seq_len=256,
        batch_size=8,
        steps=400,
        lr=3e-3,
        warmup_steps=20,
        eval_blocks=48,
    ),
    "prose-draft": EmbeddedSpec(
        PROSE,
        hidden_size=96,
        num_layers=1,
        num_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        seq_len=256,
        batch_size=8,
        steps=100,
        lr=3e-3,
        warmup_steps=8,
        eval_blocks=48,
    ),
    # A micro pair for tests: builds in seconds.
    "tiny": EmbeddedSpec(
        TINY,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        seq_len=64,
        batch_size=8,
        steps=20,
        lr=3e-3,
        warmup_steps=2,
        eval_blocks=8,
        threads=1,  # ops this small only pay for splitting across threads
    ),
    "tiny-draft": EmbeddedSpec(
        TINY,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
        seq_len=64,
        batch_size=8,
        steps=10,
        lr=3e-3,
        warmup_steps=1,
        eval_blocks=8,
        threads=1,  # ops this small only pay for splitting across threads
    ),
}


# Fields added after builds were cached, left out of a record at these defaults so that the
# builds made before them stay current.
_LATER_FIELDS = {"text": "code", "grow_from_layers": None, "grow_at_step": 0}
# Fields that older records hold but that never changed what a build produces (a display
# string): ignored when a record is compared with a spec.
_DROPPED_FIELDS = ("eta",)


def record_spec(spec: EmbeddedSpec | CorpusSpec) -> dict:
    """The spec as it reads back from a build record (JSON round trip), without the fields
    of `_LATER_FIELDS` at their defaults."""
    record = json.loads(json.dumps(asdict(spec)))
    for part in (record, record.get("corpus", {})):
        for key, default in _LATER_FIELDS.items():
            if key in part and part[key] == default:
                del part[key]
    return record


def same_spec(recorded, spec: EmbeddedSpec | CorpusSpec) -> bool:
    """Whether a build record's "spec" describes the build of `spec` (`_DROPPED_FIELDS` of an
    older record aside)."""
    if not isinstance(recorded, dict):
        return False
    recorded = {k: v for k, v in recorded.items() if k not in _DROPPED_FIELDS}
    return recorded == record_spec(spec)
