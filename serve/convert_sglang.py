"""SGLang's request dumps (pickles of `/configure_logging`'s `dump_requests_folder`) and
`/generate` JSON lines -> traffic records, for serve/convert.py.

Pickles are read with an unpickler that builds plain attribute bags and refuses every
callable, so no SGLang install is needed and no code in the file runs. A file that cannot be
read (truncated, nested too deeply, self-referencing, naming callables) becomes one
ConvertError for the file; the other files are converted.
"""

import pickle
from pathlib import Path

from specdistill.serve.convert_common import (
    AttrBag,
    ConvertError,
    category,
    json_line,
    lines,
    plain,
    record,
    sampling_params,
    speculative_stats,
)


class _SafeUnpickler(pickle.Unpickler):
    """Plain containers and attribute bags only: a dump's classes (SGLang's request types,
    enums) all become `AttrBag`s, and nothing callable from the file is ever invoked. The
    builtins it may call build at most what their arguments, read from the file, hold; `bytes`
    and `bytearray` are not among them (`bytearray(2**31)` allocates 2 GiB from a few bytes of
    pickle); the pickle opcodes still read bytes objects."""

    SAFE = {
        ("builtins", n)
        for n in (
            "dict",
            "list",
            "tuple",
            "set",
            "frozenset",
            "str",
            "int",
            "float",
            "bool",
        )
    }

    def find_class(self, module, name):
        if (module, name) in self.SAFE:
            return super().find_class(module, name)
        return AttrBag


def sglang_pairs(path: Path) -> list[tuple[str, object]]:
    """(where, (request, output)) of a dump file (pickle) or a JSON-lines file; an entry
    (or a whole file) that cannot be read is (where, ConvertError)."""
    if path.suffix in (".jsonl", ".json"):
        out = []
        for n, raw in lines(path):
            where = f"{path}:{n}"
            try:
                item = json_line(raw)
                if not isinstance(item, dict):
                    raise ConvertError(f"a line must be a JSON object, got {type(item).__name__}")
                out.append((where, (item.get("request"), item.get("output"))))
            except ConvertError as e:
                out.append((where, e))
        return out
    try:
        with open(path, "rb") as f:
            data = plain(_SafeUnpickler(f).load())
    except ConvertError as e:
        return [(str(path), ConvertError(f"unreadable dump: {e}"))]
    except Exception as e:  # a hostile or damaged pickle: truncated, callables, recursion
        return [(str(path), ConvertError(f"unreadable dump: {type(e).__name__}: {e}"))]
    items = data if isinstance(data, list) else [data]
    out = []
    for i, item in enumerate(items):
        where = f"{path}#{i}"
        if isinstance(item, list) and len(item) >= 2:
            out.append((where, (item[0], item[1])))
        else:
            out.append((where, ConvertError("a dump entry is not a (request, output, ...) tuple")))
    return out


def from_sglang(request, output, tokenizer, target: dict, fallback_id: str = "") -> dict:
    """One SGLang (request, output) pair -> a traffic record (`fallback_id` when the pair
    names no id)."""
    if not isinstance(request, dict) or not isinstance(output, dict):
        raise ConvertError("an SGLang entry needs a request and an output object")
    meta = output.get("meta_info") or {}
    prompt = request.get("text")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ConvertError("batched SGLang requests are not supported (one text each)")
        prompt = prompt[0]
    prompt_ids = request.get("input_ids")
    if prompt_ids is None:
        if not isinstance(prompt, str):
            raise ConvertError("an SGLang request needs 'text' or 'input_ids'")
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    text = output.get("text") or ""
    completion_ids = output.get("output_ids") or tokenizer.encode(text, add_special_tokens=False)
    finish = meta.get("finish_reason") or {}
    finish_reason = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
    steps = meta.get("spec_verify_ct") or 0
    speculative = speculative_stats(
        steps,
        meta.get("spec_draft_token_num") or 0,
        meta.get("spec_accept_token_num") or 0,
        meta.get("spec_accept_histogram"),
    )
    created = meta.get("created_time") or request.get("created_time")
    return record(
        rid=str(meta.get("id") or request.get("rid") or fallback_id),
        endpoint="completions",
        target=target,
        sampling=sampling_params(request.get("sampling_params") or {}),
        prompt=prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids),
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion_ids),
        completion_text=text,
        finish_reason="length" if finish_reason == "length" else "stop",
        speculative=speculative,
        category=category(request),
        top_logprobs=None,
        created=created,
        latency_s=meta.get("e2e_latency"),
    )
