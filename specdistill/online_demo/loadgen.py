"""The online demo's load: its prompt pools (held-out standard-library code, the
interpreter's help topics as prose) and its clients, threads of a standard-library HTTP
client that send completions requests to the server in timed phases.
"""

import codecs
import json
import random
import threading
import time
import urllib.request

from specdistill.data.stdlib import help_topics, stdlib_files

PHASES = ("code", "prose", "code")
# of the load time, per phase: the first code phase is the longest, so that the draft is
# fit to the code traffic when the shift comes
FRACTIONS = (0.45, 0.30, 0.25)


# ------------------------------------------------------------------------------ prompts
def code_texts(max_files: int | None = None) -> list[str]:
    """Chunks (blank-line separated blocks, merged to >= 400 chars) of held-out stdlib code."""
    files = stdlib_files("heldout")
    if max_files:
        files = files[:max_files]
    chunks = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        cur = ""
        for block in text.split("\n\n"):
            cur = f"{cur}\n\n{block}" if cur else block
            if len(cur) >= 400:
                chunks.append(cur)
                cur = ""
    return chunks


def prose_texts(cipher: bool = False) -> list[str]:
    """Paragraphs (>= 200 chars) of the interpreter's help topics (data.stdlib.help_topics'
    fine-tune split); `cipher`: enciphered with ROT13, the stand-in for a new language that
    `--shift target` teaches the served target and its draft has never seen."""
    paragraphs = []
    for text in help_topics()[0]:
        for p in text.split("\n\n"):
            p = p.strip()
            if len(p) >= 200 and not p.startswith(" "):  # prose, not indented code samples
                paragraphs.append(codecs.encode(p, "rot13") if cipher else p)
    return paragraphs


def split_pools(texts: list[str], seed: int) -> tuple[list[str], list[str]]:
    """(traffic, evaluation): a fixed shuffle, every third text held out for evaluation."""
    texts = list(texts)
    random.Random(seed).shuffle(texts)
    return [t for i, t in enumerate(texts) if i % 3], texts[::3]


def prompts_of(texts: list[str], tokenizer, prompt_tokens: int, per_text: int) -> list[list[int]]:
    """Up to `per_text` prompts of `prompt_tokens` ids from each text, cut at offsets
    `prompt_tokens` // 2 apart (each leaves at least a quarter prompt of the text after it
    for the target to continue), interleaved: every text's first prompt, then every text's
    second, so a client cycling through the pool meets each text once before any again."""
    stride = max(1, prompt_tokens // 2)
    rounds: list[list[list[int]]] = [[] for _ in range(max(1, per_text))]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        for k in range(len(rounds)):
            start = k * stride
            if k and start + prompt_tokens + prompt_tokens // 4 > len(ids):
                break
            rounds[k].append(ids[start : start + prompt_tokens])
    return [p for r in rounds for p in r if p]


# ------------------------------------------------------------------------------ load
def complete(url: str, body: dict, timeout: float = 120) -> dict:
    """POST `body` to URL/v1/completions; the response's JSON (OSError on a failure: an
    HTTP error status, a refused or timed-out connection)."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer none"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def own_server_body(args, n: int, category: str, prompt: list[int]) -> dict:
    """A request to this project's server: temperature 1, a seed per request, the category."""
    return {
        "model": args.target,  # the Server serves it under its name
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "seed": n,
        "metadata": {"category": category},
    }


def run_load(
    url: str, pools: dict, phase_seconds, args, events: list, log=None, body=own_server_body
) -> dict:
    """The clients: phase by phase, each client sends prompts one after another (one request
    at a time per client thread, no retries); `body(args, n, category, prompt)` is request n.
    Each phase's start and the end go to `events` and, as they happen, to the file `log` (one
    JSON line each), if given."""

    def event(e: dict) -> None:
        events.append(e)
        if log is not None:
            with open(log, "a") as f:
                f.write(json.dumps(e) + "\n")

    served, failures, lock = [], [], threading.Lock()
    counter = {"n": 0}

    def worker(deadline: float, category: str, pool: list):
        while time.monotonic() < deadline:
            with lock:
                n = counter["n"]
                counter["n"] += 1
            try:
                out = complete(url, body(args, n, category, pool[n % len(pool)]))
                with lock:
                    served.append({"id": out["id"], "category": category})
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    failures.append(repr(e)[:300])

    for phase, (category, seconds) in enumerate(zip(PHASES, phase_seconds, strict=True)):
        event({"event": "phase", "phase": phase + 1, "domain": category, "time": time.time()})
        print(f"online demo: phase {phase + 1}: {category} traffic for {seconds:.0f} s", flush=True)
        deadline = time.monotonic() + seconds
        threads = [
            threading.Thread(target=worker, args=(deadline, category, pools[category]))
            for _ in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    event({"event": "end", "time": time.time()})
    return {"served": served, "failures": failures}
