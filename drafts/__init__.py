"""Draft types: everything that differs between a standalone draft and an EAGLE-3 head.

The trainer, the offline evaluation, the engine and the export ask this layer and never
branch on the type themselves. A draft type (drafts/standalone.py, drafts/eagle3.py) turns a
batch into K aligned (draft logits, target logits, mask) depths (`depths`, `count_mask`),
saves a trained draft (`save`), and knows its own directories (`detect`). Both go to
`losses.multi_depth_loss` (K = 1 is the plain per-position loss) and to `eval.offline` for
α per depth.

Adding a type (an MTP or DFlash-style head): a module here with a class of the same
interface, and one entry in `TYPES`.
"""

from specdistill.drafts.eagle3 import Eagle3
from specdistill.drafts.standalone import Standalone

TYPES = {"standalone": Standalone, "eagle3": Eagle3}

__all__ = ["TYPES", "Eagle3", "Standalone"]
