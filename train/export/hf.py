"""hf: the layout of the Hugging Face Hub, which is what vLLM loads.

An EAGLE-3 head is written in the `speculators` layout, byte for byte what the vllm format
writes: it is what EAGLE-3 repositories on the Hub hold (and what `speculators` and vLLM
load). A standalone draft is the plain causal-LM directory, as for every format; a saved
standalone draft is in this layout (`drafts.Standalone.layout`), read back by `READERS`.
"""

from specdistill.train.export import vllm

WRITERS = dict(vllm.WRITERS)
READERS = dict(vllm.READERS)
HINTS = dict(vllm.HINTS)  # `hf` is the layout vLLM loads
