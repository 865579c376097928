"""Soak test of the closed loop: the server and the online job under good and hostile traffic.

    python -m benchmarks.soak                               # embedded:code + its draft, 6 min
    python -m benchmarks.soak --minutes 20 --clients 8
    python -m benchmarks.soak --target DIR --draft DIR --clean-seconds 20 --minutes 1

Two processes, as a deployment runs them, on 127.0.0.1 only:
  1. `specdistill online` in follow mode (it publishes the first draft version), trained only
     on the good client's key (`online.clients`);
  2. `specdistill serve --drafts ... --traffic ... --api-key GOOD,OTHER`, following the
     versions the job publishes.
Before the server starts, the traffic directory gets a first shard of poisoned records (as a
converted engine log can hold: NaN and negative temperatures, token ids outside the
vocabulary, wrong types, torn JSON); the server appends its own shards after it.

Then a clean phase (`--clean-seconds`: `--clients` well-behaved clients, the official openai
client, streaming and not, chat and completions) and a hostile phase (`--minutes`: the same
clients plus one hostile client cycling through the cases of `HOSTILE`: oversized and deeply
nested bodies, NaN and 1e400 numbers, prompts beyond the context, 20,000 messages, unknown
models, paths and methods, unsupported fields, missing and wrong keys, streams abandoned
mid-way, and valid requests under a key the job does not train on).

Checks (exit status 1 when one fails):
  - both processes alive at the end and exiting 0 on SIGTERM (0 crashes);
  - 0 failed good requests; every hostile case answered with its 4xx and an OpenAI-shaped
    error body (never a 5xx, never accepted);
  - every good request in the traffic log exactly once;
  - every poisoned record in the job's rejects.jsonl, no record of the untrusted key trained;
  - the server's peak RSS in the hostile phase within `--rss-slack-mb` of the clean phase's;
  - p95 latency of good requests in the hostile phase within `--max-p95-ratio` (2) of the
    clean phase's, both measured in this run.
Prints one table of the figures and writes them to `--out`/soak.json.
"""

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GOOD_KEY = "soak-good-key"
OTHER_KEY = "soak-untrusted-key"
POISON_SHARD = "traffic-000000.jsonl"  # written before the server, which appends after it
PROMPTS = Path(__file__).resolve().parent / "prompts" / "HumanEval.jsonl.gz"


def key_id(key: str) -> str:
    """The id a traffic record carries for the key that sent it (docs/traffic.md)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class Settings:
    target: str = "embedded:code"
    draft: str = "embedded:code-draft"
    clients: int = 8
    clean_seconds: float = 60.0
    minutes: float = 5.0
    max_tokens: int = 24
    prompt_chars: int = 600  # good prompts: a random cut of a HumanEval prompt, at most this long
    max_num_seqs: int = 8
    max_queue: int = 64
    rss_slack_mb: float = 256.0
    max_p95_ratio: float = 2.0
    catch_up_s: float = 120.0  # after the load: time the job gets to read the whole log
    out: str | None = None
    seed: int = 0


@dataclass
class Tally:
    """What the clients saw, phase by phase."""

    good: dict = field(default_factory=lambda: {"clean": [], "hostile": []})  # latencies
    good_ids: list = field(default_factory=list)
    good_failures: list = field(default_factory=list)
    hostile: dict = field(default_factory=dict)  # case -> [answered right, answered wrong]
    hostile_failures: list = field(default_factory=list)
    untrusted_ids: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


# ------------------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    """Resident memory of a process in MiB (`VmHWM`: its peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_recipe(s: Settings, root: Path) -> Path:
    import yaml

    recipe = {
        "target": {"model": s.target},
        "draft": {"type": "standalone", "model": s.draft},
        "data": {"max_length": 256},
        "loss": {"name": "lk_lambda"},
        "train": {"global_batch_size": 8, "micro_batch_size": 8, "lr": 1e-4, "seed": s.seed},
        "online": {
            "traffic": str(root / "traffic"),
            "drafts": str(root / "drafts"),
            "output_dir": str(root / "online"),
            "follow": True,
            "poll_s": 1.0,
            "refresh_records": 48,
            "refresh_seconds": 1e9,
            "refresh_steps": 4,
            "holdout_size": 16,
            "min_holdout": 8,
            "min_category_samples": 2,
            "bootstrap_samples": 200,
            "clients": [key_id(GOOD_KEY)],
        },
    }
    path = root / "online.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def poison_shard(traffic: Path, identity_hint: dict) -> dict[int, str]:
    """traffic-000000.jsonl of poisoned records (a converted log gone wrong): {byte offset:
    name} of each line (a record refused while parsing has no id; its offset names it).

    Each is a schema-valid-looking record with one field that must never reach the loss.
    `identity_hint` is a well-formed record's target block, so the only fault is the one
    injected (a record of another target would be refused for that instead).
    """
    base = {
        "schema_version": 1,
        "time": time.time(),
        "endpoint": "completions",
        "target": identity_hint,
        "draft_version": None,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "seed": 0, "stop": []},
        "prompt": "def f():",
        "prompt_token_ids": [5, 6, 7],
        "completion_token_ids": [8, 9, 10],
        "completion_text": "x",
        "finish_reason": "length",
        "speculative": None,
        "category": None,
        "top_logprobs": None,
        "client": key_id(GOOD_KEY),  # poisoned as if from the trusted client
    }
    lines, ids = [], []

    def add(name, change):
        rec = json.loads(json.dumps(base))
        rec["id"] = f"poison-{name}"
        change(rec)
        ids.append(rec["id"])
        lines.append(json.dumps(rec, allow_nan=True))

    add("nan-temperature", lambda r: r["sampling"].update(temperature=float("nan")))
    add("inf-temperature", lambda r: r["sampling"].update(temperature=float("inf")))
    add("negative-temperature", lambda r: r["sampling"].update(temperature=-1.0))
    add("top-p-5", lambda r: r["sampling"].update(top_p=5.0))
    add("token-out-of-vocab", lambda r: r.update(completion_token_ids=[10**9]))
    add("negative-token", lambda r: r.update(prompt_token_ids=[-3, 4]))
    add("string-tokens", lambda r: r.update(completion_token_ids="8 9 10"))
    add("bool-temperature", lambda r: r["sampling"].update(temperature=True))
    add("empty-completion", lambda r: r.update(completion_token_ids=[]))
    lines.append('{"id": "poison-broken-json", "prompt_token_ids": [1, ')
    ids.append("poison-broken-json")
    traffic.mkdir(parents=True, exist_ok=True)
    data = "".join(line + "\n" for line in lines).encode()
    (traffic / POISON_SHARD).write_bytes(data)
    offsets, at = [], 0
    for line in data.split(b"\n")[:-1]:
        offsets.append(at)
        at += len(line) + 1
    return dict(zip(offsets, ids, strict=True))


# ------------------------------------------------------------------------------ clients
def good_client(url: str, model: str, prompts, s: Settings, tally: Tally, phase, stop, i):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=GOOD_KEY, max_retries=0, timeout=300)
    rng = random.Random(s.seed * 1000 + i)
    n = 0
    while not stop.is_set():
        n += 1
        text = rng.choice(prompts)  # a random cut: distinct prompts, as real traffic has
        prompt = text[: rng.randint(min(20, len(text)), min(len(text), s.prompt_chars))]
        kind = n % 3
        start = time.perf_counter()
        try:
            if kind == 0:  # completion, not streamed
                out = client.completions.create(
                    model=model, prompt=prompt, max_tokens=s.max_tokens, temperature=1.0
                )
                rid = out.id
            elif kind == 1:  # completion, streamed
                rid = None
                for chunk in client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=s.max_tokens,
                    temperature=1.0,
                    stream=True,
                ):
                    rid = chunk.id
            else:  # chat, not streamed
                out = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=s.max_tokens,
                    temperature=0.7,
                )
                rid = out.id
            with tally.lock:
                tally.good[phase[0]].append(time.perf_counter() - start)
                tally.good_ids.append(rid)
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            with tally.lock:
                tally.good_failures.append(f"{phase[0]}: {e!r}"[:300])


class _Chunked:
    """A body sent without Content-Length (chunked), `total` bytes, anew on every request."""

    def __init__(self, total: int, size: int = 1 << 16):
        self.total, self.size = total, size

    def __iter__(self):
        sent = 0
        while sent < self.total:
            n = min(self.size, self.total - sent)
            sent += n
            yield b" " * n


def hostile_cases(model: str, context: int):
    """(name, request kwargs for httpx, the statuses that are right, needs the good key)."""
    big = b'{"model": "%s", "prompt": "' % model.encode() + b"a" * (8 << 20) + b'"}'
    long_prompt = " ".join(["def"] * (context * 3))
    messages = [{"role": "user", "content": "hi"}] * 20000
    j = lambda obj: {"content": json.dumps(obj).encode()}  # noqa: E731
    comp = "/v1/completions"
    return [
        ("body-8MiB", dict(method="POST", url=comp, content=big), {413}),
        ("body-8MiB-chunked", dict(method="POST", url=comp, content=_Chunked(8 << 20)), {413}),
        ("nested-100k", dict(method="POST", url=comp, content=b"[" * 100_000), {400, 413, 422}),
        (
            "nan-temperature",
            dict(
                method="POST",
                url=comp,
                content=b'{"model": "%s", "prompt": "a", "temperature": NaN}' % model.encode(),
            ),
            {400, 422},
        ),
        (
            "n-1e400",
            dict(method="POST", url=comp, content=b'{"prompt": "a", "n": 1e400}'),
            {400, 422},
        ),
        (
            "max-tokens-1e9",
            dict(method="POST", url=comp, **j({"prompt": "a", "max_tokens": 10**9})),
            {400, 422},
        ),
        (
            "prompt-3x-context",
            dict(method="POST", url=comp, **j({"prompt": long_prompt})),
            {400, 413},
        ),
        (
            "20000-messages",
            dict(method="POST", url="/v1/chat/completions", **j({"messages": messages})),
            {400, 413, 422},
        ),
        ("unknown-model", dict(method="POST", url=comp, **j({"model": "x", "prompt": "a"})), {404}),
        (
            "logit-bias",
            dict(method="POST", url=comp, **j({"prompt": "a", "logit_bias": {"5": 100}})),
            {400, 422},
        ),
        (
            "json-object",
            dict(
                method="POST",
                url="/v1/chat/completions",
                **j(
                    {
                        "messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "json_object"},
                    }
                ),
            ),
            {400, 422},
        ),
        ("not-json", dict(method="POST", url=comp, content=b"\xff\xfe{prompt"), {400, 422}),
        ("get-on-post", dict(method="GET", url=comp), {405}),
        ("unknown-path", dict(method="GET", url="/v1/nothing"), {404}),
    ]


def hostile_process(url: str, model: str, context: int, stop, results) -> None:
    """The hostile client in a process of its own (so that its work on the client side does
    not hold the good clients' GIL); its tally goes back through `results`."""
    tally = Tally()
    hostile_client(url, model, context, tally, stop)
    results.put((tally.hostile, tally.hostile_failures, tally.untrusted_ids))


def hostile_client(url: str, model: str, context: int, tally: Tally, stop):
    import httpx

    cases = hostile_cases(model, context)
    good = {"Authorization": f"Bearer {GOOD_KEY}"}
    with httpx.Client(base_url=url, timeout=120) as http:

        def note(name, right, why=""):
            with tally.lock:
                tally.hostile.setdefault(name, [0, 0])[0 if right else 1] += 1
                if not right:
                    tally.hostile_failures.append(f"{name}: {why}"[:300])

        def call(name, request, statuses, headers):
            try:
                r = http.request(headers=headers, **request)
            except httpx.HTTPError as e:
                note(name, False, repr(e))
                return
            try:
                shaped = isinstance(r.json()["error"]["message"], str)
            except (ValueError, KeyError, TypeError):
                shaped = False
            note(name, r.status_code in statuses and shaped, f"{r.status_code} {r.text[:120]}")

        i = 0
        while not stop.is_set():
            name, request, statuses = cases[i % len(cases)]
            call(name, request, statuses, good)
            if i % 4 == 0:  # no key, a wrong key
                call("no-key", dict(method="POST", url="/v1/completions"), {401}, {})
                bad = {"Authorization": "Bearer wrong"}
                call("wrong-key", dict(method="POST", url="/v1/completions"), {401}, bad)
            if i % 5 == 0:  # a stream abandoned after its first event
                try:
                    with http.stream(
                        "POST",
                        "/v1/completions",
                        headers=good,
                        json={"model": model, "prompt": "def", "max_tokens": 64, "stream": True},
                    ) as r:
                        for _ in r.iter_bytes():
                            break
                    note("abandoned-stream", r.status_code == 200, str(r.status_code))
                except httpx.HTTPError as e:
                    note("abandoned-stream", False, repr(e))
            if i % 3 == 0:  # a valid request under a key the job does not train on
                try:
                    r = http.post(
                        "/v1/completions",
                        headers={"Authorization": f"Bearer {OTHER_KEY}"},
                        json={"model": model, "prompt": "zzzz " * 20, "max_tokens": 8},
                    )
                    ok = r.status_code == 200
                    if ok:
                        with tally.lock:
                            tally.untrusted_ids.append(r.json()["id"])
                    note("untrusted-key", ok, str(r.status_code))
                except httpx.HTTPError as e:
                    note("untrusted-key", False, repr(e))
            i += 1


# ------------------------------------------------------------------------------ the run
def percentile(values, q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def load_prompts(n: int = 164) -> list[str]:
    import gzip

    with gzip.open(PROMPTS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def wait_for(predicate, seconds: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.5)


def stop_process(proc: subprocess.Popen, seconds: float = 60) -> int | None:
    """SIGTERM, wait; the exit status (None: it had to be killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(s: Settings) -> dict:
    root = Path(s.out or tempfile.mkdtemp(prefix="soak-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "specdistill"]
    logs = {name: open(root / f"{name}.log", "w") for name in ("online", "serve")}
    target_block = {"name": s.target, "identity": identity_of(s.target)}
    poison_ids = poison_shard(root / "traffic", target_block)
    recipe = write_recipe(s, root)
    job = subprocess.Popen(
        [*cli, "online", "--recipe", str(recipe)],
        stdout=logs["online"],
        stderr=subprocess.STDOUT,
        env=env,
    )
    procs = {"online": job}
    try:
        wait_for(lambda: (root / "drafts" / "current").is_file(), 600, "the first version", job)
        port = free_port()
        server = subprocess.Popen(
            [*cli, "serve", "--target", s.target, "--drafts", str(root / "drafts"),
             "--traffic", str(root / "traffic"), "--port", str(port), "--threads", "1",
             "--api-key", f"{GOOD_KEY},{OTHER_KEY}", "--max-num-seqs", str(s.max_num_seqs),
             "--max-queue", str(s.max_queue), "--max-tokens", str(s.max_tokens),
             "--served-model-name", "soak", "--poll-s", "1"],
            stdout=logs["serve"], stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        procs["serve"] = server
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url), 300, "the server", server)
        context = _context(s.target)
        figures = load_phases(s, url, server, context)
        alive = {name: p.poll() is None for name, p in procs.items()}
        stop_process(server)  # SIGTERM: drains; its exit status is read below
        # every good request was logged when its response completed; the job reads to the end
        deadline = time.monotonic() + s.catch_up_s
        while not _job_read(root) and time.monotonic() < deadline and job.poll() is None:
            time.sleep(1.0)
    finally:
        codes = {name: stop_process(p) for name, p in procs.items()}  # returncode if exited
        for f in logs.values():
            f.close()
    figures["job_read_every_line"] = _job_read(root)
    figures.update(check(s, root, figures, alive, codes, poison_ids))
    (root / "soak.json").write_text(json.dumps(figures, indent=2, default=str))
    return figures


def identity_of(target: str) -> str:
    from specdistill.models.hub import load_target
    from specdistill.models.identity import model_identity

    return model_identity(target, load_target(target))


def _context(target: str) -> int:
    from transformers import AutoConfig

    from specdistill.models.hub import local_model_dir

    path = local_model_dir(target) or target
    return int(AutoConfig.from_pretrained(path).max_position_embeddings)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def log_lines(root: Path) -> int:
    """Complete lines in the traffic log's shards (the poisoned one included)."""
    from specdistill.formats.traffic_shards import shards

    return sum(p.read_bytes().count(b"\n") for p in shards(root / "traffic"))


def served_records(root: Path) -> list[dict]:
    """The server's records (every shard but the poisoned one)."""
    from specdistill.formats.traffic_shards import shards

    return [
        json.loads(line)
        for p in shards(root / "traffic")
        if p.name != POISON_SHARD
        for line in p.read_bytes().split(b"\n")
        if line.strip()
    ]


def job_state(root: Path) -> dict | None:
    """The online job's committed state (OUT/state/trainer_state.json, OUT = ROOT/online), or
    None when it has committed none."""
    from specdistill.train.online.dirs import STATE
    from specdistill.train.run_plan import STATE_FILE

    path = root / "online" / STATE / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _job_read(root: Path) -> bool:
    """The job's committed cursor has consumed every line of the log."""
    state = job_state(root)
    return state is not None and state["cursor"]["lines"] >= log_lines(root)


def untrusted_trained(root: Path, untrusted: set) -> int | None:
    """How many of the untrusted key's records the job trained on; None when the job has
    committed no state (nothing to check: the check fails)."""
    state = job_state(root)
    return None if state is None else len(untrusted & set(state["trained_ids"]))


def load_phases(s: Settings, url: str, server, context: int) -> dict:
    tally = Tally()
    prompts = load_prompts()
    phase = ["clean"]
    stop = threading.Event()
    rss = {"clean": 0.0, "hostile": 0.0}
    threads = [
        threading.Thread(target=good_client, args=(url, "soak", prompts, s, tally, phase, stop, i))
        for i in range(s.clients)
    ]
    for t in threads:
        t.start()
    t0 = time.monotonic()

    def sample(until: float, name: str):
        while time.monotonic() < until and server.poll() is None:
            rss[name] = max(rss[name], rss_mb(server.pid))
            time.sleep(0.5)

    sample(t0 + s.clean_seconds, "clean")
    phase[0] = "hostile"
    ctx = multiprocessing.get_context("spawn")
    hstop, results = ctx.Event(), ctx.Queue()
    hostile = ctx.Process(target=hostile_process, args=(url, "soak", context, hstop, results))
    hostile.start()
    sample(time.monotonic() + s.minutes * 60, "hostile")
    hstop.set()
    stop.set()
    tally.hostile, tally.hostile_failures, tally.untrusted_ids = results.get(timeout=600)
    hostile.join()
    for t in threads:
        t.join()
    duration = time.monotonic() - t0
    p95 = {k: percentile(v, 0.95) for k, v in tally.good.items()}
    return {
        "duration_s": round(duration, 1),
        "good_requests": len(tally.good_ids),
        "good_failures": tally.good_failures,
        "hostile_requests": sum(a + b for a, b in tally.hostile.values()),
        "hostile_cases": tally.hostile,
        "hostile_failures": tally.hostile_failures[:50],
        "untrusted_requests": len(tally.untrusted_ids),
        "p95_good_clean_s": p95["clean"],
        "p95_good_hostile_s": p95["hostile"],
        "p95_ratio": p95["hostile"] / p95["clean"] if p95["clean"] else float("nan"),
        "peak_rss_clean_mb": round(rss["clean"], 1),
        "peak_rss_hostile_mb": round(rss["hostile"], 1),
        "_good_ids": tally.good_ids,
        "_untrusted_ids": tally.untrusted_ids,
    }


def check(s: Settings, root: Path, f: dict, alive: dict, codes: dict, poison_ids) -> dict:
    from collections import Counter

    logged = Counter(r["id"] for r in served_records(root))
    good_ids = f.pop("_good_ids")
    untrusted = set(f.pop("_untrusted_ids"))
    rejects = {
        r["offset"]
        for r in read_jsonl(root / "online" / "rejects.jsonl")
        if r.get("shard") == POISON_SHARD
    }
    state = job_state(root)
    trained = set(state["trained_ids"]) if state is not None else set()
    results = {
        "processes_alive": alive,
        "exit_codes": codes,
        "good_logged_once": sum(logged[i] == 1 for i in good_ids),
        "poison_records": len(poison_ids),
        "poison_rejected": sum(offset in rejects for offset in poison_ids),
        "poison_not_rejected": [n for offset, n in poison_ids.items() if offset not in rejects],
        "untrusted_trained": untrusted_trained(root, untrusted),
        "trained_records": len(trained),
        "versions": sorted(p.name for p in (root / "drafts").glob("v*")),
    }
    checks = {
        "the job read every line": f["job_read_every_line"],
        "0 crashes": all(alive.values()) and all(c == 0 for c in codes.values()),
        "0 failed good requests": not f["good_failures"] and f["good_requests"] > 0,
        "every hostile case answered right": not f["hostile_failures"]
        and f["hostile_requests"] > 0,
        "every good request logged exactly once": results["good_logged_once"] == len(good_ids),
        "every poisoned record rejected": results["poison_rejected"] == len(poison_ids),
        "no untrusted record trained": results["untrusted_trained"] == 0,
        "peak RSS within the bound": f["peak_rss_hostile_mb"]
        <= f["peak_rss_clean_mb"] + s.rss_slack_mb,
        "p95 within the ratio": f["p95_ratio"] <= s.max_p95_ratio,
    }
    results["checks"] = checks
    return results


def print_table(f: dict, s: Settings) -> None:
    rows = [
        ("duration", f"{f['duration_s']:.0f} s ({s.clean_seconds:.0f} s clean)"),
        ("good requests / failed", f"{f['good_requests']} / {len(f['good_failures'])}"),
        ("hostile requests / answered wrong", f"{f['hostile_requests']} / "
         f"{len(f['hostile_failures'])}"),
        ("untrusted-key requests / trained", f"{f['untrusted_requests']} / "
         f"{f['untrusted_trained']}"),
        ("poisoned records / rejected", f"{f['poison_records']} / {f['poison_rejected']}"),
        ("good logged exactly once", f"{f['good_logged_once']} / {f['good_requests']}"),
        ("peak RSS clean / hostile", f"{f['peak_rss_clean_mb']:.0f} / "
         f"{f['peak_rss_hostile_mb']:.0f} MiB (bound +{s.rss_slack_mb:.0f})"),
        ("p95 good clean / hostile", f"{f['p95_good_clean_s']:.2f} / "
         f"{f['p95_good_hostile_s']:.2f} s (ratio {f['p95_ratio']:.2f}, bound "
         f"{s.max_p95_ratio})"),
        ("trained records, versions", f"{f['trained_records']}, {len(f['versions'])}"),
        ("exit codes", json.dumps(f["exit_codes"])),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for name, ok in f["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")


def main(argv=None) -> int:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for name, value in asdict(d).items():
        kind = type(value) if value is not None else str
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    s = Settings(**vars(p.parse_args(argv)))
    figures = run(s)
    print_table(figures, s)
    return 0 if all(figures["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
