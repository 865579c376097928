"""The `online` section of the recipe: `specdistill online` (train/online/job.py)."""

from specdistill.train.recipe_types import (
    ClientIds,
    Float,
    OnlinePolicy,
    Section,
    Strings,
    recipe_key,
)


class OnlineConfig(Section):
    """`specdistill online` (train/online/job.py): learn from the server's traffic log."""

    traffic: str | None = recipe_key(
        None, "the server's --traffic directory (shards traffic-NNNNNN.jsonl)"
    )
    drafts: str = recipe_key(
        "runs/online/drafts", "the published root the server follows (--drafts)"
    )
    output_dir: str = recipe_key(
        "runs/online", "the job's state/, rejects.jsonl, decisions.jsonl, metrics.jsonl"
    )
    overwrite: bool = recipe_key(
        False,
        "true: reuse a used output_dir that is not this job's own state (same target "
        "and drafts root), replacing its logs; otherwise it is refused",
    )
    clients: ClientIds | None = recipe_key(
        None,
        "train only on the records of these clients (the server's client field: key- + "
        "the first 12 hex digits of sha256(API key)); empty or null: every client's records",
    )
    follow: bool = recipe_key(
        False, "true: tail new shards and appended lines; false: one pass, then exit"
    )
    policy: OnlinePolicy = recipe_key(
        "specdistill",
        "specdistill: replay + held-out gate. osd: OSD's policy (arXiv "
        "2310.07177): an update on every refresh_records new records, no replay, no hold-out, "
        "no gate, every update published (use it with loss.name=fkl)",
    )
    poll_s: Float = recipe_key(2.0, "seconds between looks at the traffic directory", gt=0)
    refresh_records: int = recipe_key(
        64, "a refresh after this many new trainable records ...", ge=1
    )
    refresh_seconds: Float = recipe_key(
        600.0, "... or after this many seconds (with at least min_refresh_records)", gt=0
    )
    min_refresh_records: int = recipe_key(1, "new records a timed refresh needs", ge=1)
    refresh_steps: int = recipe_key(
        20, "optimiser steps per refresh (more if the new records need them)", ge=1
    )
    max_refreshes: int = recipe_key(0, "stop after this many refreshes (0: no limit)", ge=0)
    recent_size: int = recipe_key(512, "the bounded store of recent records", ge=1)
    reservoir_size: int = recipe_key(
        512, "a uniform reservoir sample of the records older than those", ge=0
    )
    anchor: Strings = recipe_key(
        description="traffic directories or .jsonl files: a fixed set replayed in every refresh",
        factory=list,
    )
    recent_ratio: Float = recipe_key(
        0.7, "share of a refresh's sequences from the recent store", gt=0, le=1
    )
    anchor_ratio: Float = recipe_key(
        0.0, "share of the rest (the replay) taken from the anchor set", ge=0, le=1
    )
    holdout_size: int = recipe_key(64, "the newest trainable records, held out for the gate", ge=1)
    min_holdout: int = recipe_key(8, "fewer held-out sequences: no promotion", ge=1)
    max_record_tokens: int | None = recipe_key(
        None,
        "prompt + completion tokens of a record; longer ones are rejected; null: data.max_length",
        ge=1,
    )
    max_line_bytes: int = recipe_key(
        4 * 1024 * 1024,
        "longer traffic lines are rejected (at least 4 KiB: a record's line fits)",
        ge=4096,
        le=1 << 30,
    )
    dedup_size: int = recipe_key(
        100_000,
        "(prompt, completion) keys remembered: exact repeats are dropped (0: none)",
        ge=0,
        le=10_000_000,
    )
    max_per_prompt: int = recipe_key(
        4, "records of one prompt held at once (holdout, recent, reservoir)", ge=1
    )
    bootstrap_samples: int = recipe_key(
        1000, "resamples of the gate's paired bootstrap", ge=100, le=100_000
    )
    confidence: Float = recipe_key(
        0.95, "two-sided level of the paired bootstrap interval of Δα", gt=0, lt=1
    )
    min_gain: Float = recipe_key(0.0, "promote only if the interval's lower bound is above this")
    min_category_samples: int = recipe_key(
        10, "held-out sequences a category needs to count in the regression check", ge=1
    )
    max_regression: Float = recipe_key(
        0.05, "a category (>= min_category_samples) may drop this much α", ge=0
    )
    keep_versions: int = recipe_key(5, "published versions kept", ge=2)
    watch_window: int = recipe_key(50, "served records per rolling-α window", ge=1)
    watch_trailing: int = recipe_key(5, "windows in the trailing level", ge=1)
    watch_drop: Float = recipe_key(
        0.1, "alert when a window's α is this far below the trailing level"
    )
    sparse_targets: bool = recipe_key(
        False,
        "train on the records' top_logprobs as sparse targets with a rest bin, "
        "skipping the target's forward, when every record of a refresh carries them and the "
        "loss allows it (temperature 1, no top_p/top_k, no chunk_size, a standalone draft)",
    )
