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

Input files are read as bytes and split at b"\\n" only (JSON strings may hold U+2028 and
other characters that `str.splitlines` would split at). Every line, dump file and entry is
converted and checked in full before anything is appended: a line that is not UTF-8, not
JSON, not an object, holds a non-finite or out-of-range sampling parameter (top_p 0
included) or statistic, a string with a lone surrogate, a chat message that is not text, or
no completion tokens; a pickle that is truncated, nested deeper than MAX_DEPTH or names
callables; each is one reject, counted by reason and written to OUT/rejects.jsonl with its
`file:line` (or `file#entry`), and the conversion goes on with the next. The target identity
is computed as the server computes it (`model_identity`), so the online job accepts the
converted records exactly when they come from its own target.

Converting is idempotent: a record whose key (its id, prompt and completion token ids) is
already in OUT's traffic log is skipped, so a rerun, an input converted twice or a run cut
short and repeated appends each record once. A source entry without an id gets one derived
from its content (`<source>-<sha256 prefix>`). A reject already in OUT/rejects.jsonl (same
source and reason) is counted again but not written twice.
"""

import hashlib
import json
import math
from pathlib import Path

from specdistill.errors import UserError
from specdistill.formats.traffic_shards import shards
from specdistill.serve.convert_common import (
    NO_SPECULATION,
    ConvertError,
    category,
    content_id,
    json_line,
    lines,
    record,
    sampling_params,
    speculative_stats,
    token_ids,
)
from specdistill.serve.convert_sglang import from_sglang, sglang_pairs
from specdistill.serve.traffic import TrafficLog

SOURCES = ("vllm", "sglang")


# ----------------------------------------------------------------------------- vLLM


def from_vllm(line: dict, tokenizer, target: dict, fallback_id: str = "") -> dict:
    """One `{"request", "response"}` pair of vLLM's OpenAI server -> a traffic record
    (`fallback_id` when the pair names no id)."""
    if not isinstance(line, dict):
        raise ConvertError(f"a line must be a JSON object, got {type(line).__name__}")
    request, response = line.get("request"), line.get("response")
    if not isinstance(request, dict) or not isinstance(response, dict):
        raise ConvertError("a line needs 'request' and 'response' objects")
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise ConvertError(f"expected one choice (n=1), got {len(choices)}")
    choice = choices[0]
    chat = "messages" in request
    if chat:
        prompt = chat_messages(request["messages"])
        text = (choice.get("message") or {}).get("content")
        if text is not None and not isinstance(text, str):
            raise ConvertError(f"the reply's content must be a string, got {type(text).__name__}")
        text = text or ""
        prompt_ids = response.get("prompt_token_ids") or tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        prompt = request.get("prompt")
        given_ids = _token_id_prompt(prompt)
        if given_ids is None and not isinstance(prompt, str):
            raise ConvertError("a completions request needs a 'prompt': a string or token ids")
        text = choice.get("text") or ""
        prompt_ids = choice.get("prompt_token_ids") or response.get("prompt_token_ids")
        if given_ids is not None and prompt_ids and list(prompt_ids) != given_ids:
            raise ConvertError("the response's prompt_token_ids differ from the prompt's ids")
        prompt_ids = prompt_ids or given_ids or tokenizer.encode(prompt, add_special_tokens=False)
    completion_ids = choice.get("token_ids") or tokenizer.encode(text, add_special_tokens=False)
    if not completion_ids:
        raise ConvertError("an empty completion (no completion tokens to learn from)")
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
        rid=str(response.get("id") or line.get("id") or fallback_id),
        endpoint="chat.completions" if chat else "completions",
        target=target,
        sampling=sampling_params(request),
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion_ids),
        completion_text=text,
        finish_reason=choice.get("finish_reason") or "stop",
        speculative=speculative,
        category=category(request),
        top_logprobs=top,
        created=response.get("created"),
        latency_s=line.get("latency_s"),
    )


def _token_id_prompt(prompt) -> list[int] | None:
    """A completions prompt given as token ids (a non-empty list of non-negative ints)."""
    if isinstance(prompt, list) and prompt:
        if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt):
            return list(prompt)
    return None


def chat_messages(messages) -> list[dict]:
    """A chat request's messages as the server logs them: a non-empty list of {"role": str,
    "content": str}, text parts ([{"type": "text", "text": str}, ...]) joined; ConvertError
    naming the first message that is not."""
    if not isinstance(messages, list) or not messages:
        raise ConvertError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str) or not isinstance(message.get("role"), str):
            raise ConvertError(
                f"messages[{i}] needs a string 'role' and a string (or text parts) 'content'"
            )
        out.append({**message, "content": content})
    return out


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
        ids = token_ids(tokenizer, [token for token, _ in entry])
        out.append(
            [
                [i, float(lp) if math.isfinite(lp) else -1e30]
                for i, (_, lp) in zip(ids, entry, strict=True)
            ]
        )
    return out


# ----------------------------------------------------------------------------- driver


def record_key(record: dict) -> str:
    """What makes two traffic records the same record: id, prompt and completion ids."""
    body = json.dumps(
        [record.get("id"), record.get("prompt_token_ids"), record.get("completion_token_ids")],
        separators=(",", ":"),
    )
    return hashlib.sha256(body.encode()).hexdigest()


def logged_keys(out: Path) -> set[str]:
    """`record_key`s of every complete line of OUT's traffic shards (unreadable lines and a
    torn final line are passed over: they are no record to duplicate)."""
    keys = set()
    if not out.is_dir():
        return keys
    for path in shards(out):
        for raw in path.read_bytes().split(b"\n")[:-1]:
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                keys.add(record_key(record))
    return keys


def _logged_rejects(path: Path) -> set[tuple]:
    seen = set()
    if path.is_file():
        for raw in path.read_bytes().split(b"\n"):
            try:
                item = json.loads(raw)
                seen.add((item["source"], item["reason"]))
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
    return seen


def _check_ids(record: dict, vocab: int) -> dict:
    for key in ("prompt_token_ids", "completion_token_ids"):
        bad = next((t for t in record[key] if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConvertError(f"{key} holds {bad}, outside the target's {vocab} token ids")
    return record


def check_out(out: Path) -> None:
    """UserError when OUT exists and is not a directory (a traffic directory)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory (a traffic directory)")


def _make_out(out: Path) -> None:
    check_out(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror or e})") from None


def convert(source: str, inputs: list[Path], tokenizer, target: dict, out: Path) -> dict:
    """Append every convertible record not yet in `out`'s traffic log to it; rejects to
    out/rejects.jsonl. Returns {"converted": n, "already_logged": n, "rejected": {reason: n}}."""
    if source not in SOURCES:
        raise UserError(f"--from must be one of {', '.join(SOURCES)}, got {source!r}")
    _make_out(out)
    keys = logged_keys(out)
    written_rejects = _logged_rejects(out / "rejects.jsonl")
    vocab = len(tokenizer)

    def build(item) -> dict:
        """A source entry's record (its content id, when it names none, is computed here too,
        inside the checks)."""
        fallback = content_id(source, item)
        if source == "vllm":
            return from_vllm(item, tokenizer, target, fallback)
        return from_sglang(*item, tokenizer, target, fallback)

    rejected: dict[str, int] = {}
    converted = already = 0
    log: TrafficLog | None = None  # opened at the first new record: a rerun adds no shard
    try:
        with open(out / "rejects.jsonl", "a", encoding="utf-8") as rejects:

            def reject(where: str, reason: str) -> None:
                key = reason.split(" (")[0][:80]
                rejected[key] = rejected.get(key, 0) + 1
                if (where, reason) not in written_rejects:
                    written_rejects.add((where, reason))
                    rejects.write(json.dumps({"source": where, "reason": reason}) + "\n")
                    rejects.flush()

            def one(where: str, item) -> None:
                nonlocal converted, already, log
                try:  # the whole record is built and checked before it is appended
                    record = _check_ids(build(item), vocab)
                except (ConvertError, ValueError, KeyError, TypeError, AttributeError,
                        IndexError, RecursionError) as e:  # fmt: skip
                    reject(where, str(e) or type(e).__name__)
                    return
                except Exception as e:  # e.g. a chat template that fails on the messages
                    reject(where, f"{type(e).__name__}: {e}")
                    return
                key = record_key(record)
                if key in keys:
                    already += 1
                    return
                log = log or TrafficLog(out)
                log.append(record)
                keys.add(key)
                converted += 1

            for path in inputs:
                for where, item in _entries(source, path):
                    if isinstance(item, ConvertError):
                        reject(where, str(item))
                    else:
                        one(where, item)
    finally:
        if log is not None:
            log.close()
    return {"converted": converted, "already_logged": already, "rejected": rejected}


def _entries(source: str, path: Path) -> list[tuple[str, object]]:
    """(where, source entry or ConvertError) of one input file."""
    if source == "sglang":
        return sglang_pairs(path)
    out = []
    for n, raw in lines(path):
        try:
            out.append((f"{path}:{n}", json_line(raw)))
        except ConvertError as e:
            out.append((f"{path}:{n}", e))
    return out


def input_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return [path]
