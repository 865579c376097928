"""One lock around every Hugging Face model load and construction in specdistill.

transformers 5 turns weight tying off while `from_pretrained` runs by replacing
`PreTrainedModel.tie_weights` on the class with a no-op, and on exit puts back whatever it
found on entry (`transformers.initialization.no_tie_weights`). Two loads in two threads of
one process (the server's draft watcher and an online job, say) can interleave so that the
second load saves the first one's no-op and puts it back last: from then on no model the
process builds or loads ties its output head to its input embedding, and a tied draft
(embedded:code-draft, Qwen2.5-0.5B) gets a random `lm_head`, silently. Upstream:
huggingface/transformers#44940. Holding `model_lock()` around each load makes them one at a
time, and restores the real method if a load outside specdistill left the no-op behind.
"""

import contextlib
import threading
from collections.abc import Iterator

from transformers import PreTrainedModel

_LOCK = threading.RLock()
_TIE_WEIGHTS = PreTrainedModel.tie_weights


@contextlib.contextmanager
def model_lock() -> Iterator[None]:
    with _LOCK:
        if PreTrainedModel.tie_weights is not _TIE_WEIGHTS:
            PreTrainedModel.tie_weights = _TIE_WEIGHTS
        yield
