"""Online distillation from the server's traffic log: read, refresh, gate, publish, watch.

    specdistill online --recipe recipes/online.yaml [key.sub=value ...] [--follow | --once]
    specdistill online rollback [VERSION] --drafts ROOT      # default: the parent of current
    specdistill online demo --out DIR [--minutes M]           # serve + shift + learn + OSD

The job reads `online.traffic` (the shards `specdistill serve --traffic` writes) after its
committed cursor (train/online/cursor.py), screens each record (train/online/screen.py:
schema, the target identity as the server computes it, size, the range of every field that
reaches the loss, the gate or the watch; the refused ones are counted by reason and written
to OUT/rejects.jsonl; records of clients outside `online.clients` are counted and skipped),
drops exact repeats and a prompt's records beyond `online.max_per_prompt`, and files the
rest into the store (train/online/store.py): the newest `online.holdout_size` records are
held out for the gate, older ones are trainable. Every `online.refresh_records` new
trainable records (or `online.refresh_seconds`), a refresh (train/online/refresh.py) runs
`online.refresh_steps` optimiser steps of the step core (train/step.py, the offline run's own
step) on every new record once plus replay (recent store, reservoir, anchor), warm-started
from the running draft and its optimiser state, against the frozen target with the recipe's
loss. The gate (train/online/gate.py) compares candidate and the served incumbent
(ROOT/current) on the held-out slice; a promotion is published as a new version
(train/online/versions.py). Each decision goes to OUT/decisions.jsonl and stdout.

Directories (train/online/dirs.py): OUT and ROOT are locked for the job's lifetime (a
second job or a rollback on either fails at once); a used OUT that is not this job's own is
refused unless `online.overwrite`.

Crash safety: the cursor, the store, the counters, the ids of the trained records, the
running draft and its optimiser state, and the sizes of the three logs are committed
together, atomically, as one checkpoint (OUT/state, train/run_dir.py), after each refresh
and at the end of a pass. A restart loads that state and cuts the logs back to the committed
sizes, so a record read after the last commit is read again, once: none is skipped, none is
counted twice.

Targets: when every record of a refresh carries the target's top_logprobs (the server's
--log-top-logprobs K, or converted vLLM/SGLang logprobs) and online.sparse_targets is on (off
by default, docs/online.md), the refresh trains on them as sparse targets with a rest bin
(docs/theory.md §3) and skips the target's forward; otherwise it runs the frozen target. The
gate always runs the target (exact α on the held-out slice).

Drafts: a standalone draft or an EAGLE-3 head (`draft.type: eagle3`). A head is refreshed
on the target's features (the draft type's `depths`), gated on its depth-0 α, published in
the speculators layout its type saves and served by `--drafts` like any version. Its V_d is
fixed: `draft.model` names a trained head (e.g. `specdistill distill` with
recipes/code-eagle3.yaml), or a fresh head takes V_d = V or builds V_d from the anchor set.

Not done: multi-process training.
"""

import copy
import json
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from specdistill.errors import run_guarded
from specdistill.threads import ThreadPolicy
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.online.args import job_parser
from specdistill.train.online.dirs import LOGS, STATE
from specdistill.train.online.intake import TrafficInput
from specdistill.train.online.refresh import Refreshes
from specdistill.train.online.served import ServedVersions, initial_manifest
from specdistill.train.run_dir import Faults, no_faults


class OnlineJob(TrafficInput, ServedVersions, Refreshes):
    """One online job on OUT and ROOT. `faults`: a hook called with the name of each
    crash-test point the job passes (tests only; a no-op otherwise)."""

    def __init__(
        self,
        recipe,
        *,
        print=print,
        faults: Faults = no_faults,
        threads: ThreadPolicy | None = None,
    ):
        from specdistill.train.online import dirs as online_dirs

        self._locks = []
        self.print = print
        self.threads = threads  # re-checked before each refresh (specdistill/threads.py)
        self.faults = faults
        r = copy.deepcopy(recipe)
        # A refresh is a continuation, not a schedule: constant learning rate.
        r.train = r.train.model_copy(update={"warmup_steps": 0, "min_lr_ratio": 1.0})
        self.recipe, o = r, r.online
        self.o = o
        if o.traffic is None:
            raise RecipeError("online.traffic must name the server's --traffic directory")
        if o.policy == "osd":  # OSD's buffer: cleared after each update; nothing held out
            o = o.model_copy(
                update={"holdout_size": 0, "recent_size": 0, "reservoir_size": 0, "anchor": []}
            )
            r.online = self.o = o
        self.out = Path(o.output_dir)
        self.root = Path(o.drafts)
        # OUT and ROOT: one job each, held until run() ends or close(); OUT claimed.
        self._locks = online_dirs.lock_dirs(self.out, self.root, overwrite=o.overwrite)
        try:
            self._build(r, o)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release OUT and ROOT (the end of the job's lifetime; `run` calls it)."""
        from specdistill.train.online import dirs as online_dirs

        online_dirs.release(self._locks)
        self._locks = []

    def _build(self, r, o) -> None:
        import torch
        from accelerate import Accelerator

        from specdistill import drafts
        from specdistill.drafts.identity import model_identity
        from specdistill.drafts.target_spec import TargetSpec, load_target_and_tokenizer
        from specdistill.train.batches import accumulation_steps
        from specdistill.train.online.cursor import Cursor
        from specdistill.train.online.screen import load_anchor
        from specdistill.train.online.store import Store
        from specdistill.train.online.watch import Watch
        from specdistill.train.run_dir import RunDir
        from specdistill.train.step import DistillStep

        self.clients = set(o.clients or ())
        self._said: set[str] = set()  # warnings given once
        self.max_tokens = o.max_record_tokens or r.data.max_length
        # The recipe's target.adapter (a fine-tuned target, unmerged) is part of the target:
        # the identity covers its files, as the server's does (`specdistill serve
        # --target-adapter`), so records of the bare base or of another adapter are refused.
        self.target, self.tokenizer = load_target_and_tokenizer(TargetSpec.from_recipe(r.target))
        self.identity = model_identity(r.target.model, self.target, r.target.adapter)
        self.vocab_size = len(self.tokenizer)
        anchor = load_anchor(o.anchor, self.identity, self.max_tokens, self.vocab_size)
        draft, kind = drafts.build(
            r.draft, self.target, self.tokenizer, self._vocab_data(anchor), print=lambda *a: None
        )
        self.kind = kind  # the draft type: read, never assigned to (the step core has it too)
        acc = Accelerator(cpu=not torch.cuda.is_available())
        accumulation_steps(r, acc)  # the global batch splits into micro-batches
        self.core = DistillStep(r, accelerator=acc, target=self.target, draft=draft, kind=kind)
        self.on_policy = self._on_policy() if r.data.on_policy.fraction > 0 else None
        self.run_dir = RunDir(self.out, acc, faults=self.faults)
        self.cursor = Cursor()
        self.store = Store(
            o.recent_size,
            o.reservoir_size,
            o.holdout_size,
            o.dedup_size,
            o.max_per_prompt,
            rng_state=r.train.seed,
        )
        self.store.anchor = anchor
        self.watch = Watch(o.watch_window, o.watch_trailing, o.watch_drop)
        self.counts: Counter = Counter()
        self.trained_ids: list[str] = []
        self.refreshes = 0
        self.records_since = 0  # new trainable records since the last refresh
        self.window_start: float | None = None  # time of the first record of this window
        self.last_refresh = time.time()
        self.known_current: str | None = None  # the version the running draft descends from
        self._incumbent = (None, None)  # (version, model)
        self.pending: dict | None = None  # {"version", "manifest"}: a promotion being published
        self.stop_event = threading.Event()  # set: a follow run ends after the current step
        self._recover()

    def _vocab_data(self, anchor: list):
        """What a fresh EAGLE-3 head (draft.model null) builds its V_d from: the anchor set's
        completion tokens. None where nothing is needed (a standalone draft, a trained head,
        or V_d = V); a RecipeError where a V_d < V has nothing to be built from."""
        from specdistill.data.dataset import TokenDataset
        from specdistill.drafts import planned

        d = self.recipe.draft
        if not planned(d).capabilities.fresh or d.model is not None:
            return None
        if d.vocab_size is None or d.vocab_size >= self.vocab_size:
            return None
        if not anchor:
            raise RecipeError(
                "specdistill online with draft.type=eagle3: draft.model must be a trained "
                "EAGLE-3 head directory (e.g. from specdistill distill), or a fresh head needs "
                "draft.vocab_size null (V_d = V) or an online.anchor set to build its draft "
                "vocabulary from"
            )
        return TokenDataset([it.tokens() for it in anchor], n_records=len(anchor), skipped={})

    def _on_policy(self):
        """The generator of data.on_policy rows (train/on_policy.py), as the offline run's."""
        from specdistill.train.on_policy import OnPolicy

        return OnPolicy(
            self.recipe,
            target=self.core.target,
            draft=self.core.draft_module(),
            tokenizer=self.tokenizer,
            vocab_size=self.core.vocab_size,
            device=self.core.accelerator.device,
        )

    # ----------------------------------------------------------------------------- state
    def _recover(self) -> None:
        from specdistill.formats.published import read_current
        from specdistill.publish import atomic_write_text, remove_leftovers
        from specdistill.train.online import dirs as online_dirs
        from specdistill.train.online import versions as online_versions
        from specdistill.train.online.cursor import Cursor
        from specdistill.train.run_dir import read_state

        remove_leftovers(self.root)
        self.run_dir.recover(STATE)
        state_dir = self.out / STATE
        s = None
        if online_dirs.has_state(self.out):
            s = read_state(state_dir)
            if s["identity"] != self.identity:
                if not self.o.overwrite:
                    raise RecipeError(
                        f"{state_dir}: state of target {s['identity']}, the recipe's target is "
                        f"{self.identity}; use another online.output_dir, or set "
                        "online.overwrite=true to replace that state and its logs"
                    )
                online_dirs.forget(self.out)
                s = None
        if s is not None:
            self.run_dir.load(state_dir, self.core)
            self.cursor = Cursor.from_dict(s["cursor"])
            self.store.load(s["store"])
            self.watch.load(s["watch"])
            self.counts = Counter(s["counts"])
            self.trained_ids = s["trained_ids"]
            self.refreshes = s["refreshes"]
            self.records_since = s["records_since"]
            self.known_current = s["known_current"]
            self.pending = s.get("pending")
            self.run_dir.truncate_logs(s["log_bytes"])
            self.print(
                f"online: resumed at {self.cursor.as_dict()} after "
                f"{self.refreshes} refreshes, {len(self.trained_ids)} records trained"
            )
            if self.pending is not None:
                self._complete_pending()
        else:
            online_dirs.forget(self.out)
            current = read_current(self.root)
            left = online_versions.versions(self.root)
            if current is None and left:  # killed between a first publish and its `current`
                atomic_write_text(self.root / "current", left[-1] + "\n")
                current = left[-1]
            student = self.core.draft_module()
            if current is None:
                version = self._publish(student, initial_manifest())
                self.print(f"online: published the initial draft as {version}")
            else:
                model = self._try_load_version(current)
                if model is not None:
                    student.load_state_dict(model.state_dict())
                    self.print(f"online: starting from the served version {current}")
                self.known_current = current
        self._follow_external_change()

    def commit(self) -> None:
        """Everything the job knows, as of now, replaces OUT/state in one rename: a
        checkpoint of the step core (train/run_dir.py) with the job's own state."""
        state = {
            "identity": self.identity,
            "cursor": self.cursor.as_dict(),
            "store": self.store.state(),
            "watch": self.watch.state(),
            "counts": dict(self.counts),
            "trained_ids": self.trained_ids,
            "refreshes": self.refreshes,
            "records_since": self.records_since,
            "known_current": self.known_current,
            "pending": self.pending,
            "log_bytes": self.run_dir.log_sizes(LOGS),
        }
        self.run_dir.commit(self.out / STATE, self.core, state, self.recipe)

    # ----------------------------------------------------------------------------- run
    def run(self, follow: bool | None = None) -> dict:
        from specdistill.train.online import dirs as online_dirs

        if not self._locks:  # a job run again after close()
            self._locks = online_dirs.lock_dirs(self.out, self.root)
        follow = self.o.follow if follow is None else follow
        stop = {"now": False}
        catch = follow and threading.current_thread() is threading.main_thread()
        if catch:  # SIGTERM ends a follow job after the current step, with a commit

            def handler(signum, frame):
                stop["now"] = True

            old = signal.signal(signal.SIGTERM, handler)
        try:
            self._check_traffic(follow)
            while True:
                if follow:
                    self._check_traffic(follow)
                self.read()
                limit = self.o.max_refreshes
                while self.due(final=not follow) and not (limit and self.refreshes >= limit):
                    if self.threads is not None:
                        self.threads.recheck(say=self.print)
                    self.refresh()
                    self.read()
                if (
                    not follow
                    or stop["now"]
                    or self.stop_event.is_set()
                    or (limit and self.refreshes >= limit)
                ):
                    break
                time.sleep(self.o.poll_s)
            self.commit()
        finally:
            if catch:
                signal.signal(signal.SIGTERM, old)
            self.close()
        summary = self.summary()
        self.print("online: " + json.dumps(summary))
        return summary

    def summary(self) -> dict:
        rejected = {
            k.split("/", 1)[1]: v for k, v in self.counts.items() if k.startswith("rejected/")
        }
        skipped = {
            k.split("/", 1)[1]: v for k, v in self.counts.items() if k.startswith("skipped/")
        }
        return {
            "cursor": self.cursor.as_dict(),
            "records_seen": self.counts["records_seen"],
            "skipped_by_reason": skipped,
            "shards_rewritten": self.counts["shard_rewritten"],
            "shards_gone": self.counts["shard_gone"],
            "shards_skipped": self.counts["not_a_shard"],
            "records_accepted": self.counts["records_accepted"],
            "records_trained": len(self.trained_ids),
            "records_rejected": sum(rejected.values()),
            "rejected_by_reason": rejected,
            "duplicates": self.counts["duplicate"],
            "over_prompt_cap": self.counts["prompt_cap"],
            "refreshes": self.refreshes,
            "promotions": self.counts["promotions"],
            "rejections": self.counts["rejections"],
            "heldout": len(self.store.holdout),
        }


# --------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None, *, faults: Faults = no_faults) -> int:
    """`specdistill online ...`; `faults`: the crash-test hook (tests only)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rollback":
        from specdistill.train.online.dirs import rollback_main

        return rollback_main(argv[1:])
    args = job_parser().parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    follow = True if args.follow else False if args.once else None
    threads = ThreadPolicy(recipe.train.threads, name="train.threads")
    threads.start()
    OnlineJob(recipe, faults=faults, threads=threads).run(follow=follow)
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
