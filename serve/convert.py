"""Traffic from vLLM or SGLang into the project's traffic log (docs/traffic.md), so that the
online job learns from what production engines served.

    specdistill convert-traffic --from vllm  --target Qwen/Qwen2.5-7B-Instruct \\
        --input proxy-log.jsonl --out traffic/
    specdistill convert-traffic --from sglang --target Qwen/Qwen2.5-7B-Instruct \\
        --input /tmp/sglang_request_dump --out traffic/

`vllm`: JSON lines of `{"request": <OpenAI request body>, "response": <vLLM's response>}`,
as a logging proxy in front of vLLM's OpenAI server writes them (completions or chat). The
response's `logprobs` (`top_logprobs` <= 20) become the record's top-k target logprobs, its
`metrics.speculative_decoding` (vLLM's `--per-request-spec-decode-metrics`) the speculative
statistics; `choices[0].token_ids` / `prompt_token_ids` (vLLM's `return_token_ids`) are used
when present, else the texts are tokenised with the target's tokenizer.

`sglang`: the files of `/configure_logging`'s `dump_requests_folder` (pickled lists of
(request, output, ...) tuples) or JSON lines of `{"request": ..., "output": ...}` (`/generate`
bodies and responses). `output.meta_info`'s spec_verify_ct / spec_accept_token_num /
spec_draft_token_num / spec_accept_histogram become the speculative statistics. Pickles are
read with an unpickler that builds plain attribute bags and refuses every callable, so no
SGLang install is needed and no code in the file runs.

Records that cannot be converted are counted by reason and written to OUT/rejects.jsonl;
the target identity is computed as the server computes it (`model_identity`), so the online
job accepts the converted records exactly when they come from its own target.
"""

import argparse
import json
import math
import pickle
import time
from pathlib import Path

from specdistill.serve.traffic import SCHEMA_VERSION, TrafficLog, model_identity, validate

SOURCES = ("vllm", "sglang")


class ConvertError(ValueError):
    """A source record that cannot become a traffic record (the reason is the message)."""


# ----------------------------------------------------------------------------- common


def speculative_stats(
    num_spec_steps: int, num_draft_tokens: int, num_accepted: int, histogram: list | None
) -> dict:
    """The speculative statistics in the record's (vLLM's) shape."""
    return {
        "mean_acceptance_length": 1 + num_accepted / num_spec_steps if num_spec_steps else 1.0,
        "draft_acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        "acceptance_histogram": list(histogram or []),
        "num_spec_steps": int(num_spec_steps),
        "num_draft_tokens": int(num_draft_tokens),
        "num_accepted_draft_tokens": int(num_accepted),
    }


NO_SPECULATION = speculative_stats(0, 0, 0, [])


def record(
    *,
    rid: str,
    endpoint: str,
    target: dict,
    sampling: dict,
    prompt,
    prompt_ids: list[int],
    completion_ids: list[int],
    completion_text: str,
    finish_reason: str,
    speculative: dict,
    category: str | None,
    top_logprobs: list | None,
    created: float | None,
    latency_s: float | None,
) -> dict:
    out = {
        "schema_version": SCHEMA_VERSION,
        "id": rid,
        "time": float(created if created is not None else time.time()),
        "endpoint": endpoint,
        "target": target,
        "draft_version": None,  # the serving engine's own draft: not named in its logs
        "sampling": sampling,
        "prompt": prompt,
        "prompt_token_ids": [int(t) for t in prompt_ids],
        "completion_token_ids": [int(t) for t in completion_ids],
        "completion_text": completion_text,
        "finish_reason": finish_reason or "stop",
        "speculative": speculative,
        "category": category,
        "top_logprobs": top_logprobs,
        "latency_s": float(latency_s if latency_s is not None else 0.0),
        "ttft_s": None,
    }
    return validate(out)


def _sampling(params: dict) -> dict:
    stop = params.get("stop")
    return {
        "temperature": float(params.get("temperature", 1.0)),
        "top_p": float(params.get("top_p", 1.0) or 1.0),
        "max_tokens": params.get("max_tokens", params.get("max_new_tokens")),
        "seed": params.get("seed"),
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
    }


def _category(request: dict) -> str | None:
    meta = request.get("metadata") or {}
    return meta.get("category") or request.get("category")


def _ids(tokenizer, tokens: list[str]) -> list[int]:
    """Token strings (as engines print them in logprobs) -> ids; byte-level BPE strings map
    directly, anything else is encoded."""
    ids = tokenizer.convert_tokens_to_ids(tokens)
    unk = tokenizer.unk_token_id
    out = []
    for token, i in zip(tokens, ids, strict=True):
        if i is None or (unk is not None and i == unk and token != tokenizer.unk_token):
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ConvertError(f"logprob token {token!r} is not one token of the target")
            i = encoded[0]
        out.append(int(i))
    return out


# ----------------------------------------------------------------------------- vLLM


def from_vllm(line: dict, tokenizer, target: dict) -> dict:
    """One `{"request", "response"}` pair of vLLM's OpenAI server -> a traffic record."""
    request, response = line.get("request"), line.get("response")
    if not isinstance(request, dict) or not isinstance(response, dict):
        raise ConvertError("a line needs 'request' and 'response' objects")
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise ConvertError(f"expected one choice (n=1), got {len(choices)}")
    choice = choices[0]
    chat = "messages" in request
    if chat:
        prompt = request["messages"]
        text = (choice.get("message") or {}).get("content") or ""
        prompt_ids = response.get("prompt_token_ids") or tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise ConvertError("a completions request needs a string 'prompt'")
        text = choice.get("text") or ""
        prompt_ids = choice.get("prompt_token_ids") or response.get("prompt_token_ids")
        prompt_ids = prompt_ids or tokenizer.encode(prompt, add_special_tokens=False)
    completion_ids = choice.get("token_ids") or tokenizer.encode(text, add_special_tokens=False)
    top = _vllm_top_logprobs(choice.get("logprobs"), tokenizer, chat)
    if top is not None and len(top) != len(completion_ids):
        raise ConvertError(
            f"{len(top)} logprob entries for {len(completion_ids)} completion tokens (pass "
            "return_token_ids so the ids are the engine's)"
        )
    spec = ((response.get("metrics") or {}).get("speculative_decoding")) or None
    speculative = (
        speculative_stats(
            spec.get("num_spec_steps", 0),
            spec.get("num_draft_tokens", 0),
            spec.get("num_accepted_draft_tokens", 0),
            spec.get("acceptance_histogram"),
        )
        if spec
        else NO_SPECULATION
    )
    return record(
        rid=str(response.get("id") or line.get("id") or ""),
        endpoint="chat.completions" if chat else "completions",
        target=target,
        sampling=_sampling(request),
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion_ids),
        completion_text=text,
        finish_reason=choice.get("finish_reason") or "stop",
        speculative=speculative,
        category=_category(request),
        top_logprobs=top,
        created=response.get("created"),
        latency_s=line.get("latency_s"),
    )


def _vllm_top_logprobs(logprobs, tokenizer, chat: bool) -> list | None:
    """OpenAI logprobs -> per completion token, [[token_id, logprob], ...] (None if absent)."""
    if not logprobs:
        return None
    if chat:
        entries = [
            [(t["token"], t["logprob"]) for t in (item.get("top_logprobs") or [])]
            for item in logprobs.get("content") or []
        ]
    else:
        entries = [list((d or {}).items()) for d in logprobs.get("top_logprobs") or []]
    if not any(entries):
        return None
    out = []
    for entry in entries:
        ids = _ids(tokenizer, [token for token, _ in entry])
        out.append(
            [
                [i, float(lp) if math.isfinite(lp) else -1e30]
                for i, (_, lp) in zip(ids, entry, strict=True)
            ]
        )
    return out


# ----------------------------------------------------------------------------- SGLang


class _Bag:
    """Stands in for any class a pickle names: keeps the state it is given, runs nothing."""

    def __init__(self, *args, **kwargs):
        self._args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def get(self, key, default=None):
        return self.__dict__.get(key, default)


class _SafeUnpickler(pickle.Unpickler):
    """Plain containers and attribute bags only: a dump's classes (SGLang's request types,
    enums) all become `_Bag`s, and nothing callable from the file is ever invoked."""

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
            "bytes",
            "bytearray",
        )
    }

    def find_class(self, module, name):
        if (module, name) in self.SAFE:
            return super().find_class(module, name)
        return _Bag


def _plain(value):
    """_Bags -> dicts, recursively (so the converter reads dumps and JSON alike)."""
    if isinstance(value, _Bag):
        return {k: _plain(v) for k, v in value.__dict__.items() if k != "_args"}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def sglang_pairs(path: Path):
    """(request, output) dicts from a dump file (pickle) or a JSON-lines file."""
    if path.suffix in (".jsonl", ".json"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    item = json.loads(line)
                except ValueError as e:
                    yield ConvertError(f"{path}:{n}: invalid JSON ({e})")
                    continue
                yield item.get("request"), item.get("output")
        return
    with open(path, "rb") as f:
        data = _plain(_SafeUnpickler(f).load())
    items = data if isinstance(data, list) else [data]
    for item in items:
        if isinstance(item, list) and len(item) >= 2:
            yield item[0], item[1]
        else:
            yield ConvertError(f"{path}: a dump entry is not a (request, output, ...) tuple")


def from_sglang(request, output, tokenizer, target: dict) -> dict:
    """One SGLang (request, output) pair -> a traffic record."""
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
        rid=str(meta.get("id") or request.get("rid") or ""),
        endpoint="completions",
        target=target,
        sampling=_sampling(request.get("sampling_params") or {}),
        prompt=prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids),
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion_ids),
        completion_text=text,
        finish_reason="length" if finish_reason == "length" else "stop",
        speculative=speculative,
        category=_category(request),
        top_logprobs=None,
        created=created,
        latency_s=meta.get("e2e_latency"),
    )


# ----------------------------------------------------------------------------- driver


def convert(source: str, inputs: list[Path], tokenizer, target: dict, out: Path) -> dict:
    """Append every convertible record to the traffic log in `out`; rejects to
    out/rejects.jsonl. Returns {"converted": n, "rejected": {reason: n}}."""
    if source not in SOURCES:
        raise ValueError(f"--from must be one of {', '.join(SOURCES)}, got {source!r}")
    out.mkdir(parents=True, exist_ok=True)
    log = TrafficLog(out)
    rejected: dict[str, int] = {}
    converted = 0
    with open(out / "rejects.jsonl", "a") as rejects:

        def reject(where: str, reason: str) -> None:
            key = reason.split(" (")[0][:80]
            rejected[key] = rejected.get(key, 0) + 1
            rejects.write(json.dumps({"source": where, "reason": reason}) + "\n")

        for path in inputs:
            if source == "vllm":
                pairs = []
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    if not line.strip():
                        continue
                    try:
                        pairs.append((f"{path}:{n}", json.loads(line)))
                    except ValueError as e:
                        reject(f"{path}:{n}", f"invalid JSON ({e})")
                for where, item in pairs:
                    try:
                        log.append(from_vllm(item, tokenizer, target))
                        converted += 1
                    except (ValueError, KeyError, TypeError) as e:
                        reject(where, str(e))
            else:
                for i, pair in enumerate(sglang_pairs(path)):
                    if isinstance(pair, ConvertError):
                        reject(str(path), str(pair))
                        continue
                    try:
                        log.append(from_sglang(*pair, tokenizer, target))
                        converted += 1
                    except (ValueError, KeyError, TypeError) as e:
                        reject(f"{path}#{i}", str(e))
    log.close()
    return {"converted": converted, "rejected": rejected}


def _inputs(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--from", dest="source", required=True, choices=SOURCES)
    parser.add_argument("--input", required=True, help="a file, or a directory of files")
    parser.add_argument("--target", required=True, help="the model the engine served")
    parser.add_argument("--out", required=True, help="traffic directory to append to")
    parser.add_argument(
        "--target-adapter",
        default=None,
        help="the peft LoRA adapter the engine served on --target (its files enter the "
        "identity, as with `specdistill serve --target-adapter`)",
    )
    parser.add_argument(
        "--target-identity",
        default=None,
        help="the identity the online job expects (a record's target.identity from "
        "`specdistill serve`); default: computed from --target as the server does, which "
        "matches for a local model directory",
    )
    args = parser.parse_args(argv)

    from specdistill.drafts.hub import load_tokenizer

    inputs = _inputs(Path(args.input))
    tokenizer = load_tokenizer(args.target)
    identity = args.target_identity or model_identity(args.target, adapter=args.target_adapter)
    name = f"{args.target}+{args.target_adapter}" if args.target_adapter else args.target
    target = {"name": name, "identity": identity}
    result = convert(args.source, inputs, tokenizer, target, Path(args.out))
    reasons = ", ".join(f"{k}: {v}" for k, v in result["rejected"].items()) or "none"
    print(f"converted {result['converted']} records into {args.out}; rejected: {reasons}")
    return 0


if __name__ == "__main__":
    import sys

    from specdistill.errors import run_guarded

    sys.exit(run_guarded(main, sys.argv[1:]))
