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

import contextlib
import copy
import json
import signal
import sys
import threading
import time
from pathlib import Path

from specdistill.errors import run_guarded
from specdistill.publish import remove_leftovers
from specdistill.threads import ThreadPolicy
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.online.args import job_parser
from specdistill.train.online.context import Context, build_context
from specdistill.train.online.dirs import LOGS, STATE, forget, has_state, lock_dirs, release
from specdistill.train.online.dirs import rollback_main as online_rollback_main
from specdistill.train.online.intake import Intake
from specdistill.train.online.refresh import Refresh
from specdistill.train.online.served import Served
from specdistill.train.recipe import Recipe
from specdistill.train.run_dir import Faults, RunDir, no_faults, read_state


class OnlineJob:
    """One online job on OUT and ROOT: the shared `Context` (context.py), built once, and
    the parts it is handed to, each with its own state: `intake` (the traffic into the
    store), `served` (ROOT: incumbent, publishing) and `refresher` (steps and gate). The job
    runs them in turn and commits their state together. `faults`: a hook called with the
    name of each crash-test point the job passes (tests only; a no-op otherwise)."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        print=print,
        faults: Faults = no_faults,
        threads: ThreadPolicy | None = None,
    ):
        r = job_recipe(recipe)
        o = r.online
        self.threads = threads  # re-checked before each refresh (specdistill/threads.py)
        self.stop_event = threading.Event()  # set: a follow run ends after the current step
        # OUT and ROOT: one job each, held until run() ends or close(); OUT claimed.
        self.locks = lock_dirs(Path(o.output_dir), Path(o.drafts), overwrite=o.overwrite)
        try:
            self.ctx: Context = build_context(r, print=print, faults=faults)
            self.run_dir = RunDir(self.ctx.out, self.ctx.core.accelerator, faults=faults)
            self.intake = Intake(self.ctx)
            self.served = Served(self.ctx)
            self.refresher = Refresh(self.ctx, self.served)
            self._recover()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release OUT and ROOT (the end of the job's lifetime; `run` calls it)."""
        release(self.locks)
        self.locks = []

    # ----------------------------------------------------------------------------- state
    def _recover(self) -> None:
        """Resume from OUT/state, or start afresh (the served side publishes the running
        draft or starts from ROOT's current version); then follow a moved `current`."""
        ctx = self.ctx
        remove_leftovers(ctx.root)
        self.run_dir.recover(STATE)
        state = self._committed_state()
        if state is not None:
            self._resume(state)
        else:
            forget(ctx.out)
            self.served.start()
        self.served.follow_external_change()

    def _committed_state(self) -> dict | None:
        """OUT/state's contents when they are this target's; a RecipeError when they are
        another's, unless online.overwrite (then they are forgotten: None)."""
        ctx = self.ctx
        if not has_state(ctx.out):
            return None
        state_dir = ctx.out / STATE
        state = read_state(state_dir)
        if state["identity"] == ctx.identity:
            return state
        if not ctx.online.overwrite:
            raise RecipeError(
                f"{state_dir}: state of target {state['identity']}, the recipe's target is "
                f"{ctx.identity}; use another online.output_dir, or set "
                "online.overwrite=true to replace that state and its logs"
            )
        forget(ctx.out)
        return None

    def _resume(self, state: dict) -> None:
        """Each part takes its committed state; the logs are cut back to it."""
        ctx = self.ctx
        self.run_dir.load(ctx.out / STATE, ctx.core)
        self.intake.load(state)
        ctx.store.load(state["store"])
        ctx.counts.clear()
        ctx.counts.update(state["counts"])
        self.refresher.load(state)
        self.served.load(state)
        self.run_dir.truncate_logs(state["log_bytes"])
        ctx.print(
            f"online: resumed at {self.intake.cursor.as_dict()} after "
            f"{self.refresher.refreshes} refreshes, {len(self.refresher.trained_ids)} records "
            "trained"
        )
        if self.served.pending is not None:
            done = self.served.complete_pending()
            self.commit()
            ctx.print(f"online: {done}")

    def commit(self) -> None:
        """Everything the job knows, as of now, replaces OUT/state in one rename: a
        checkpoint of the step core (train/run_dir.py) with the parts' state."""
        ctx = self.ctx
        state = {
            "identity": ctx.identity,
            **self.intake.state(),  # cursor, watch
            "store": ctx.store.state(),
            "counts": dict(ctx.counts),
            **self.refresher.state(),  # trained_ids, refreshes
            "records_since": len(ctx.store.new),  # new trainable records since the last refresh
            **self.served.state(),  # known_current, pending
            "log_bytes": self.run_dir.log_sizes(LOGS),
        }
        self.run_dir.commit(ctx.out / STATE, ctx.core, state, ctx.recipe)

    # ----------------------------------------------------------------------------- run
    def run(self, follow: bool | None = None) -> dict:
        """Read, refresh when due, until the traffic is read (one pass) or the job is
        stopped (follow: `stop_event`, SIGTERM in the main thread, online.max_refreshes);
        commit, release OUT and ROOT, print and return the summary."""
        if not self.locks:  # a job run again after close()
            self.locks = lock_dirs(self.ctx.out, self.ctx.root)
        follow = self.ctx.online.follow if follow is None else follow
        catch = follow and threading.current_thread() is threading.main_thread()
        try:
            with sigterm_sets(catch) as sigterm:
                self._loop(follow, sigterm)
        finally:
            self.close()
        summary = self.summary()
        self.ctx.print("online: " + json.dumps(summary))
        return summary

    def _loop(self, follow: bool, sigterm: threading.Event) -> None:
        o = self.ctx.online
        self.intake.check_traffic(follow)
        while True:
            if follow:
                self.intake.check_traffic(follow)
            self.intake.read()
            while self.refresher.due(final=not follow) and not self._at_max_refreshes():
                if self.threads is not None:
                    self.threads.recheck(say=self.ctx.print)
                self.refresh()
                self.intake.read()
            stopped = sigterm.is_set() or self.stop_event.is_set()
            if not follow or stopped or self._at_max_refreshes():
                break
            time.sleep(o.poll_s)
        self.commit()

    def request_refresh(self) -> None:
        """A refresh as soon as online.min_refresh_records new records wait (thread-safe)."""
        self.refresher.request()

    def _at_max_refreshes(self) -> bool:
        limit = self.ctx.online.max_refreshes
        return bool(limit and self.refresher.refreshes >= limit)

    def refresh(self) -> dict:
        """One refresh (refresh.py) after following a moved `current`; a promotion is
        published (served.py) with its pending marker committed first; then a commit."""
        self.served.follow_external_change()
        decision, manifest = self.refresher.run(self.intake.cursor.as_dict())
        if manifest is not None:
            student = self.ctx.core.draft_module()
            self.served.publish_promotion(student, manifest, decision["version"], self.commit)
        self.commit()
        return decision

    def summary(self) -> dict:
        counts = self.ctx.counts
        rejected = {k.split("/", 1)[1]: v for k, v in counts.items() if k.startswith("rejected/")}
        skipped = {k.split("/", 1)[1]: v for k, v in counts.items() if k.startswith("skipped/")}
        return {
            "cursor": self.intake.cursor.as_dict(),
            "records_seen": counts["records_seen"],
            "skipped_by_reason": skipped,
            "shards_rewritten": counts["shard_rewritten"],
            "shards_gone": counts["shard_gone"],
            "shards_skipped": counts["not_a_shard"],
            "records_accepted": counts["records_accepted"],
            "records_trained": len(self.trained_ids),
            "records_rejected": sum(rejected.values()),
            "rejected_by_reason": rejected,
            "duplicates": counts["duplicate"],
            "over_prompt_cap": counts["prompt_cap"],
            "refreshes": self.refresher.refreshes,
            "promotions": counts["promotions"],
            "rejections": counts["rejections"],
            "heldout": len(self.ctx.store.holdout),
        }

    # ----------------------------------------------------------------------------- views
    # What the tests and the online demo read of a job: the shared context's and the parts'.
    @property
    def target(self):
        return self.ctx.target

    @property
    def tokenizer(self):
        return self.ctx.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.ctx.vocab_size

    @property
    def core(self):
        return self.ctx.core

    @property
    def kind(self):
        """The draft type: read, never assigned to (the step core has it)."""
        return self.ctx.core.kind

    @property
    def store(self):
        return self.ctx.store

    @property
    def trained_ids(self) -> list[str]:
        return self.refresher.trained_ids

    def load_version(self, version: str):
        return self.served.load_version(version)

    def incumbent(self):
        return self.served.incumbent()

    def refresh_batches(self, items, sparse: bool):
        return self.refresher.refresh_batches(items, sparse)


def job_recipe(recipe: Recipe) -> Recipe:
    """The job's own copy of `recipe`: a refresh is a continuation, not a schedule (constant
    learning rate); OSD's buffer is cleared after each update, with nothing held out."""
    r = copy.deepcopy(recipe)
    r.train = r.train.model_copy(update={"warmup_steps": 0, "min_lr_ratio": 1.0})
    if r.online.traffic is None:
        raise RecipeError("online.traffic must name the server's --traffic directory")
    if r.online.policy == "osd":
        r.online = r.online.model_copy(
            update={"holdout_size": 0, "recent_size": 0, "reservoir_size": 0, "anchor": []}
        )
    return r


@contextlib.contextmanager
def sigterm_sets(catch: bool):
    """An event that SIGTERM sets while the block runs (`catch`: the handler is installed,
    in the main thread only), so that a follow job ends after the current step, with a
    commit; the old handler is put back after."""
    event = threading.Event()
    if not catch:
        yield event
        return
    old = signal.signal(signal.SIGTERM, lambda signum, frame: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGTERM, old)


# --------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None, *, faults: Faults = no_faults) -> int:
    """`specdistill online ...`; `faults`: the crash-test hook (tests only)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rollback":
        return online_rollback_main(argv[1:])
    args = job_parser().parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    follow = True if args.follow else False if args.once else None
    threads = ThreadPolicy(recipe.train.threads, name="train.threads")
    threads.start()
    OnlineJob(recipe, faults=faults, threads=threads).run(follow=follow)
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
