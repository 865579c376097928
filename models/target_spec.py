"""Which target a run or a verb uses, and the one way it and its tokenizer are loaded.

A `TargetSpec` names the target: the model (an HF id, a local directory, `embedded:<name>`
or `registry:<name>`), the peft adapter put on it unmerged, the hub revision, the dtype of
its weights and the device it moves to (None: where it loads). It comes from a recipe's
`target` section (`TargetSpec.from_recipe`) or from a verb's flags (`TargetSpec.from_args`:
`--target`, `--target-adapter`, `--dtype`).

`load_target_and_tokenizer` loads both through models/hub.py with every field of the spec,
and gives the tokenizer a pad token (its eos token) when it has none, as batching needs one.
Every verb, the trainer, the online job, `prepare`, `regenerate` and `cache` load their
target here; models/hub.py's `load_target` itself is called nowhere else but where a base
model is merged with a fine-tune's adapter (train/finetune.py), which is no run's target.
"""

from dataclasses import dataclass

__all__ = ["TargetSpec", "load_target_and_tokenizer", "load_tokenizer", "with_pad_token"]


@dataclass(frozen=True)
class TargetSpec:
    """The target to load: `model` with `adapter` (None: the base alone) at `revision`
    (None: the default branch), its weights in `dtype` (a key of `hub.DTYPES` or "auto"),
    moved to `device` once loaded (None: left where it loads)."""

    model: str
    adapter: str | None = None
    revision: str | None = None
    dtype: str = "float32"
    device: str | None = None

    @classmethod
    def from_recipe(cls, target, device: str | None = None) -> "TargetSpec":
        """The spec of a recipe's `target` section (train/recipe.py `TargetConfig`)."""
        return cls(
            model=target.model,
            adapter=target.adapter,
            revision=target.revision,
            dtype=target.dtype,
            device=device,
        )

    @classmethod
    def from_args(cls, args, device: str | None = None) -> "TargetSpec":
        """The spec a verb's flags give: `args.target`, `args.target_adapter` and
        `args.dtype` (speculate's arguments, serve's options); no revision flag exists."""
        return cls(model=args.target, adapter=args.target_adapter, dtype=args.dtype, device=device)


def with_pad_token(tokenizer):
    """`tokenizer`, padding with its eos token when it has no pad token of its own."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(spec: TargetSpec):
    """The target's tokenizer (at the spec's revision), with a pad token."""
    # lazy: models/hub.py is looked up at each call, as the verbs did: tests stand a fake in
    # for it (sys.modules), and this module stays light (no torch) for the verbs' parsers
    from specdistill.models.hub import load_tokenizer as hub_tokenizer

    return with_pad_token(hub_tokenizer(spec.model, spec.revision))


def load_target_and_tokenizer(spec: TargetSpec, *, target=None, tokenizer=None) -> tuple:
    """(target, tokenizer) of `spec`, each loaded unless given (tests, a caller that loaded
    the tokenizer first to check a draft against it). The tokenizer, given or loaded, pads with
    its eos token if it has no pad token; a loaded target is `hub.load_target`'s (the adapter
    unmerged, the revision and dtype of the spec), moved to `spec.device` when one is set."""
    from specdistill.models.hub import load_target  # lazy: looked up per call, as above

    tokenizer = load_tokenizer(spec) if tokenizer is None else with_pad_token(tokenizer)
    if target is None:
        target = load_target(spec.model, spec.adapter, dtype=spec.dtype, revision=spec.revision)
        if spec.device is not None:
            target = target.to(spec.device)
    return target, tokenizer
