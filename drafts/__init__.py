"""Draft types: everything that differs between a standalone draft and an EAGLE-3 head.

The trainer, the offline evaluation, the engine and the export ask this layer and never
branch on the type themselves. A draft type (drafts/standalone/, drafts/eagle3/) turns a
batch into K aligned (draft logits, target logits, mask) depths (`depths`, `count_mask`),
saves a trained draft (`save`), and knows its own directories (`detect`). Both go to
`losses.multi_depth_loss` (K = 1 is the plain per-position loss) and to `eval.offline` for
α per depth. For a loaded draft module, `type_of` gives its type, whose `drafter` (also
`drafter_for`) is the engine's proposer on its own KV cache (models/kv_cache.py), whose
`vocab_size_of` counts its logit columns and whose `path_logits` gives the teacher-forced
logits of the offline α along generated text (eval/stats.py).

The interface is written down as `drafts.types.DraftType` (and the engine's proposer as
`drafts.types.Drafter`); every type satisfies it (tests/eval/test_draft_contracts.py). What a
type can do (a chunked loss, the target cache, the accepted-length objective, its export
formats, ...) it declares as its `capabilities` (`drafts.types.Capabilities`); the recipe
checks, the online job and the export ask those, of the type a recipe's `draft` section
trains (`planned`), and never the type's name.
`compared_vocab_size` is the one rule for the logit columns a target and a loaded draft are
compared over (the engine, the offline α, drift).

A standalone draft with a reduced output vocabulary (FR-Spec, drafts/standalone/reduced_vocab.py) is
the `ReducedStandalone` variant of the standalone type (drafts/standalone/): its
`name` is "standalone", `Standalone.build` returns it for `draft.vocab_size`, and `detect` /
`type_of` tell it apart (it trains over V_d and exports as hf only). A parallel draft with a
reduced output vocabulary is likewise `ReducedParallel` (drafts/parallel/).

Each type is a subpackage (drafts/standalone/, drafts/parallel/, drafts/eagle3/) holding its
model, its hooks and its registration (drafts/registry.py `register`, a decorator on its
class, with a priority): `TYPES` (the recipe's `draft.type` names), `detect` (a directory),
`type_of` (a loaded module) and the loader (drafts/loader.py, drafts/checked_load.py) ask the
registry, in priority order, and never name a type. Adding a type (an MTP or DFlash-style
head): a subpackage here with a class that satisfies `DraftType`, declares its
`capabilities` and its `exports` (its export writers, readers and serve hints, written in its
own subpackage: drafts/export.py) and registers itself, imported below; the export verb
(train/export/) finds its writers through the registry, under its `capabilities.export_as`.
"""

from torch import nn

from specdistill.drafts import registry
from specdistill.drafts.eagle3 import Eagle3, SGLangEagle3
from specdistill.drafts.parallel import Parallel, ReducedParallel
from specdistill.drafts.registry import TYPES, type_of
from specdistill.drafts.standalone import ReducedStandalone, Standalone
from specdistill.drafts.types import Capabilities, Drafter, DraftType


def build(cfg, target, tokenizer, train_data, *, print=print):
    """(draft module, draft type instance) for a recipe's `draft` section (`cfg.type` names
    the type), built or loaded for `target`; `train_data` gives an EAGLE-3 head its V_d."""
    return TYPES[cfg.type].build(cfg, target, tokenizer, train_data, print=print)


def planned(cfg) -> type[DraftType]:
    """The draft type class a recipe's `draft` section trains, as far as the section tells
    (`DraftType.planned`: e.g. a reduced-vocabulary variant): whose `capabilities` the recipe
    checks and the online job ask."""
    return TYPES[cfg.type].planned(cfg)


def detect(draft) -> type[DraftType]:
    """The draft type class of a directory (`registry.detect`: each class's `detect(path)`
    recognises its own directories, asked in priority order; `SGLangEagle3` is an EAGLE-3
    head in SGLang's layout, its `name` "eagle3"), or of an in-memory draft module
    (`type_of`). Raises a UserError (a ValueError) for a directory without config.json,
    which is no draft of any type."""
    if isinstance(draft, nn.Module):
        return type_of(draft)
    return registry.detect(draft)


def drafter_for(model, vocab_size: int, device) -> Drafter:
    """The speculative decoding engine's drafter for a loaded draft (eval/engine.py)."""
    return type_of(model).drafter(model, vocab_size, device)


def compared_vocab_size(*targets, draft=None) -> int:
    """The logit columns compared between one or more targets and a loaded draft (or none):
    the fewest any of them produces. A target counts its output head's rows; a draft what
    its type says (`vocab_size_of`: an EAGLE-3 head counts with its target vocabulary).
    Columns past a smaller head are never drafted, so comparing them would only add the
    other model's padding rows.
    """
    if not targets:
        raise ValueError("compared_vocab_size needs at least one target model")
    heads = [t.get_output_embeddings().weight.shape[0] for t in targets]
    if draft is not None:
        heads.append(type_of(draft).vocab_size_of(draft))
    return min(heads)


__all__ = [
    "TYPES",
    "Capabilities",
    "DraftType",
    "Drafter",
    "Eagle3",
    "Parallel",
    "ReducedParallel",
    "ReducedStandalone",
    "SGLangEagle3",
    "Standalone",
    "compared_vocab_size",
    "detect",
    "drafter_for",
    "planned",
    "type_of",
]
