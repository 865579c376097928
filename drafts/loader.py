"""Loading a draft by its type: the type the registry finds for it (drafts/registry.py
`loading`: a local directory's detected type, else the fallback for a hub name) loads it with
its `load` hook (a standalone or parallel draft: an ordinary causal LM, loaded by
models/hub.py's `load_model`; an EAGLE-3 head: drafts/eagle3/head.py), and the acceptance head
saved beside it is attached (drafts/acceptance_head.py).

The load is all or nothing, as every load through models/hub.py is: weights that do not cover
the config are an `IncompleteDraftError`, a file that cannot be read a `BrokenWeightsError`,
and weights (the acceptance head's too) holding a NaN or an infinity a
`NonFiniteWeightsError`, each naming the file (models/weights.py). The server's draft (--draft,
hot swap), speculate, drift, export and the online job load their drafts here. The model is
loaded through models/hub.py's functions as they are at the call (a test's stand-in for
`hub.load_model` stands in here too).
"""

from pathlib import Path

from specdistill.drafts.acceptance_head import WEIGHTS as HEAD_WEIGHTS
from specdistill.drafts.acceptance_head import attach_saved_head
from specdistill.drafts.registry import loading
from specdistill.models import hub
from specdistill.models.weights import check_finite


def load_draft(
    name: str,
    *,
    dtype: str = "float32",
    revision: str | None = None,
    use_acceptance_head: bool = True,
):
    """A draft of any registered type, by name or directory (a standalone draft like
    `load_model`, an EAGLE-3 head directory: drafts/eagle3/head.py), refused
    (IncompleteDraftError, BrokenWeightsError) unless its weights cover its config.

    A local draft directory with an acceptance head (drafts/acceptance_head.py) gives a draft
    carrying it as `model.acceptance_head`, checked like the draft's own weights; without the
    head's files, or with `use_acceptance_head=False`, the draft has no such attribute.
    Weights (the head's too) holding a NaN or an infinity are a `NonFiniteWeightsError`."""
    path = hub.local_model_dir(name)  # None: a hub name, which the fallback type loads
    model = loading(path).load(name, dtype=dtype, revision=revision)
    if use_acceptance_head and path is not None:
        head = attach_saved_head(model, path)
        if head is not None:
            check_finite(Path(path) / HEAD_WEIGHTS, head.named_parameters())
    return model
