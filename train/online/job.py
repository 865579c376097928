"""Online distillation from the server's traffic log: read, refresh, gate, publish, watch.

    specdistill online --recipe recipes/online.yaml [key.sub=value ...] [--follow | --once]
    specdistill online rollback [VERSION] --drafts ROOT      # default: the parent of current
    specdistill online demo --out DIR [--minutes M]           # serve + shift + learn + OSD
    python train/online/job.py --recipe recipes/online.yaml

The job reads `online.traffic` (the shards `specdistill serve --traffic` writes) after its
committed cursor, screens each record (schema, the target identity as serve/traffic.py
computes it, size, the range of every field that reaches the loss, the gate or the watch;
the refused ones are counted by reason and written to OUT/rejects.jsonl; records of clients
outside `online.clients` are counted and skipped), drops exact repeats and a prompt's
records beyond `online.max_per_prompt`, and files the rest into the store
(train/online/traffic.py): the newest `online.holdout_size` records are held
out for the gate, older ones are trainable. Every `online.refresh_records` new trainable
records (or `online.refresh_seconds`), a refresh runs `online.refresh_steps` optimiser steps
of the Trainer's own `train_step` on every new record once plus replay (recent store,
reservoir, anchor), warm-started from the running draft and its optimiser state, against the
frozen target with the recipe's loss. The gate (train/online/gate.py) compares candidate and
the served incumbent (ROOT/current) on the held-out slice; a promotion is published as a new
version (train/online/versions.py). Each decision goes to OUT/decisions.jsonl and stdout.

Directories (train/online/dirs.py): OUT and ROOT are locked for the job's lifetime (a
second job or a rollback on either fails at once); a used OUT that is not this job's own is
refused unless `online.overwrite`.

Crash safety: the cursor, the store, the counters, the ids of the trained records, the
running draft and its optimiser state, and the sizes of the three logs are committed
together, atomically (OUT/state, via publish_dir), after each refresh and at the end of a
pass. A restart loads that state and cuts the logs back to the committed sizes, so a record
read after the last commit is read again, once: none is skipped, none is counted twice.

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

import argparse
import copy
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from specdistill.errors import run_guarded
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.online.faults import FAULT
from specdistill.train.online.intake import TrafficInput
from specdistill.train.online.served import ServedVersions

STATE = "state"


def _truncate(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size > size:
        os.truncate(path, size)


class OnlineJob(TrafficInput, ServedVersions):
    def __init__(self, recipe, *, print=print):
        from specdistill.train.online import dirs as online_dirs

        self._locks = []
        self.print = print
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
        from specdistill.drafts import hub
        from specdistill.drafts.identity import model_identity
        from specdistill.train.online.traffic import Cursor, Store, load_anchor
        from specdistill.train.online.watch import Watch
        from specdistill.train.rundir import RunPlan
        from specdistill.train.trainer import Trainer

        self.clients = set(o.clients or ())
        self._said: set[str] = set()  # warnings given once
        self.max_tokens = o.max_record_tokens or r.data.max_length
        self.tokenizer = hub.load_tokenizer(r.target.model, r.target.revision)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The recipe's target.adapter (a fine-tuned target, unmerged) is part of the target:
        # the identity covers its files, as the server's does (`specdistill serve
        # --target-adapter`), so records of the bare base or of another adapter are refused.
        self.target = hub.load_target(
            r.target.model, r.target.adapter, dtype=r.target.dtype, revision=r.target.revision
        )
        self.identity = model_identity(r.target.model, self.target, r.target.adapter)
        self.vocab_size = len(self.tokenizer)
        anchor = load_anchor(o.anchor, self.identity, self.max_tokens, self.vocab_size)
        draft, kind = drafts.build(
            r.draft, self.target, self.tokenizer, self._vocab_data(anchor), print=lambda *a: None
        )
        self.kind = kind
        acc = Accelerator(cpu=not torch.cuda.is_available())
        plan = RunPlan(out=self.out, resume_from=[])
        self.trainer = Trainer(
            r,
            accelerator=acc,
            plan=plan,
            target=self.target,
            draft=draft,
            kind=kind,
            tokenizer=self.tokenizer,
            train_data=None,
            eval_data=None,
        )
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
        from specdistill.train.online.traffic import to_tokens

        d = self.recipe.draft
        if d.type != "eagle3" or d.model is not None:
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
        return TokenDataset([to_tokens(it) for it in anchor], n_records=len(anchor), skipped={})

    def _sync_vocab_map(self) -> None:
        """An EAGLE-3 head's d2t map, which the loss and the gate read from the draft type,
        is the running head's own (after a version's weights and buffers were loaded)."""
        if getattr(self.kind, "d2t", None) is not None:
            self.kind.d2t = self.trainer.accelerator.unwrap_model(self.trainer.draft).d2t

    # ----------------------------------------------------------------------------- state
    def _recover(self) -> None:
        import torch

        from specdistill.publish import remove_leftovers
        from specdistill.serve.drafts import read_current
        from specdistill.train.online import dirs as online_dirs
        from specdistill.train.online import versions as online_versions
        from specdistill.train.online.traffic import Cursor

        remove_leftovers(self.root)
        state_dir = self.out / STATE
        olds = sorted(self.out.glob(f".old-{STATE}-*"))
        if not state_dir.exists() and olds:  # a kill between publish_dir's two renames
            os.replace(olds[-1], state_dir)
        remove_leftovers(self.out)
        student = self.trainer.accelerator.unwrap_model(self.trainer.draft)
        s = None
        if (state_dir / "state.json").is_file():
            s = json.loads((state_dir / "state.json").read_text())
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
            self.cursor = Cursor.from_dict(s["cursor"])
            self.store.load(s["store"])
            self.watch.load(s["watch"])
            self.counts = Counter(s["counts"])
            self.trained_ids = s["trained_ids"]
            self.refreshes = s["refreshes"]
            self.records_since = s["records_since"]
            self.known_current = s["known_current"]
            self.pending = s.get("pending")
            self.trainer.step = s["step"]
            blob = torch.load(state_dir / "trainer.pt", map_location="cpu", weights_only=False)
            student.load_state_dict(blob["draft"])
            self.trainer.optimizer.load_state_dict(blob["optimizer"])
            self.trainer.scheduler.load_state_dict(blob["scheduler"])
            for name, size in s["log_bytes"].items():
                _truncate(self.out / name, size)
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
                from specdistill.publish import atomic_write_text

                atomic_write_text(self.root / "current", left[-1] + "\n")
                current = left[-1]
            if current is None:
                version = self._publish(student, {"reason": "initial draft", "records_trained": 0})
                self.print(f"online: published the initial draft as {version}")
            else:
                model = self._try_load_version(current)
                if model is not None:
                    student.load_state_dict(model.state_dict())
                    self.print(f"online: starting from the served version {current}")
                self.known_current = current
        self._sync_vocab_map()
        self._follow_external_change()

    def commit(self) -> None:
        """Everything the job knows, as of now, replaces OUT/state in one rename."""
        import torch

        from specdistill.publish import publish_dir

        FAULT("commit:before")
        tmp = self.out / f".tmp-{STATE}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        student = self.trainer.accelerator.unwrap_model(self.trainer.draft)
        torch.save(
            {
                "draft": student.state_dict(),
                "optimizer": self.trainer.optimizer.state_dict(),
                "scheduler": self.trainer.scheduler.state_dict(),
            },
            tmp / "trainer.pt",
        )
        logs = {}
        for name in ("rejects.jsonl", "decisions.jsonl", "metrics.jsonl"):
            p = self.out / name
            logs[name] = p.stat().st_size if p.exists() else 0
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
            "step": self.trainer.step,
            "log_bytes": logs,
            "time": time.time(),
        }
        (tmp / "state.json").write_text(json.dumps(state))
        FAULT("commit:written")
        publish_dir(tmp, self.out / STATE)
        FAULT("commit:after")

    # ----------------------------------------------------------------------------- refresh
    def due(self, final: bool = False) -> bool:
        n = len(self.store.new)
        if n >= self.o.refresh_records:
            return True
        if n >= self.o.min_refresh_records:
            return final or time.time() - self.last_refresh >= self.o.refresh_seconds
        return False

    def sparse_targets(self, items: list[dict]) -> bool:
        """Whether a refresh on `items` trains on their top_logprobs (online.sparse_targets):
        every record carries them and the loss can compare a rest bin."""
        r = self.recipe
        if not (r.online.sparse_targets and all(it.get("top_logprobs") for it in items)):
            return False
        lo = r.loss
        why = [
            f"{key}={value}"
            for key, value, fine in (
                ("loss.temperature", lo.temperature, lo.temperature == 1.0),
                ("loss.top_p", lo.params.get("top_p"), lo.params.get("top_p") is None),
                ("loss.top_k", lo.params.get("top_k"), lo.params.get("top_k") is None),
                ("loss.chunk_size", lo.chunk_size, lo.chunk_size is None),
                ("draft.type", r.draft.type, r.draft.type == "standalone"),
            )
            if not fine
        ]
        if why and not getattr(self, "_said_sparse", False):
            self._said_sparse = True
            self.print(
                "online: the records carry top_logprobs, but the refreshes run the target: "
                f"sparse targets need loss temperature 1, unfiltered, unchunked, a standalone "
                f"draft ({', '.join(why)})"
            )
        return not why

    def refresh(self) -> dict:
        """K optimiser steps on the new records + replay, the gate, maybe a publish, commit."""
        from specdistill.data.dataset import TokenDataset
        from specdistill.train.online.gate import by_temperature, decide, sequence_alpha
        from specdistill.train.online.traffic import RecordTargets, to_tokens

        self._follow_external_change()
        r, o, tr = self.recipe, self.o, self.trainer
        g = r.train.global_batch_size
        osd = o.policy == "osd"
        if osd:  # OSD (arXiv 2310.07177): the new records once, no replay
            fresh, replay = self.store.new_items(), []
        else:
            fresh, replay = self.store.refresh_mix(
                o.refresh_steps * g,
                o.recent_ratio,
                o.anchor_ratio,
                seed=r.train.seed * 7919 + self.refreshes,
            )
        items = fresh + replay
        tr.train_data = TokenDataset(
            [to_tokens(it) for it in items], n_records=len(items), skipped={}
        )
        sparse = self.sparse_targets(items)
        tr.cache = RecordTargets(items) if sparse else None  # None: the live target
        tr._perms = {}
        one_pass = math.ceil(len(items) / g)
        steps = max(1, one_pass) if osd else max(o.refresh_steps, one_pass)
        losses = []
        for s in range(steps):  # the Trainer's own step: loss, accumulation, clipping
            record = tr.train_step(s)
            tr.step += 1
            losses.append(record["loss"])
            FAULT("refresh:step")
        student = tr.accelerator.unwrap_model(tr.draft)
        version, incumbent = self.incumbent()
        if osd:  # no gate: every update is served
            verdict = {
                "promote": True,
                "why": "osd policy: no gate, promote always",
                "n_heldout": 0,
                "alpha_candidate": None,
                "alpha_incumbent": None,
            }
        elif version is not None and incumbent is None:
            verdict = {
                "promote": False,
                "why": f"the served version {version} does not load: roll back to a good one",
                "n_heldout": len(self.store.holdout),
                "alpha_candidate": None,
                "alpha_incumbent": None,
            }
        else:
            held = list(self.store.holdout)
            pad = self.tokenizer.pad_token_id
            cand = sequence_alpha(self.kind, self.target, student, held, pad) if held else []
            inc = sequence_alpha(self.kind, self.target, incumbent, held, pad) if held else []
            verdict = decide(
                cand, inc, [it["category"] for it in held], o, seed=r.train.seed + self.refreshes
            )
            if held:
                verdict["by_temperature"] = by_temperature(
                    cand, inc, [it["temperature"] for it in held]
                )
        self.refreshes += 1
        decision = {
            "refresh": self.refreshes,
            "time": time.time(),
            "decision": "promoted" if verdict["promote"] else "rejected",
            "why": verdict["why"],
            "incumbent": version,
            "steps": steps,
            "loss": sum(losses) / len(losses),
            "records_new": len(fresh),
            "records_replay": len(replay),
            "target": "records' top_logprobs" if sparse else "live",
            **{k: v for k, v in verdict.items() if k not in ("promote", "why")},
        }
        FAULT("refresh:gated")
        manifest = None
        if verdict["promote"]:
            from specdistill.publish import remove_leftovers
            from specdistill.train.online.versions import next_version

            window = (
                [min(it["time"] for it in fresh), max(it["time"] for it in fresh)]
                if fresh
                else None
            )
            remove_leftovers(self.root)
            decision["version"] = next_version(self.root)
            manifest = {
                "reason": "promoted",
                "policy": o.policy,
                "traffic_window": window,
                "records_trained": len(self.trained_ids) + len(fresh),
                "alpha": verdict["alpha_candidate"],
                "alpha_incumbent": verdict["alpha_incumbent"],
                "delta": verdict.get("delta"),
                "ci": verdict.get("ci"),
                "confidence": verdict.get("confidence"),
                "loss": decision["loss"],
                "cursor": self.cursor.as_dict(),
            }
        self._log("decisions.jsonl", decision)
        self.print(
            f"online refresh {self.refreshes}: {decision['decision']} "
            f"({decision['why']}); loss {decision['loss']:.4f}, {len(fresh)} new + "
            f"{len(replay)} replayed records"
            + (f" -> {decision['version']}" if "version" in decision else "")
            + (
                "; alpha by temperature (incumbent -> candidate): "
                + ", ".join(
                    f"T={t} {v['alpha_incumbent']:.3f} -> {v['alpha_candidate']:.3f}"
                    for t, v in decision["by_temperature"].items()
                )
                if len(decision.get("by_temperature") or ()) > 1
                else ""
            )
        )
        self.store.mark_trained(it["id"] for it in fresh)
        self.trained_ids.extend(it["id"] for it in fresh)
        self.counts["records_trained"] += len(fresh)
        self.counts["promotions" if verdict["promote"] else "rejections"] += 1
        self._log(
            "metrics.jsonl",
            {
                "kind": "refresh",
                **{
                    k: decision[k]
                    for k in (
                        "refresh",
                        "time",
                        "decision",
                        "loss",
                        "records_new",
                        "alpha_candidate",
                        "alpha_incumbent",
                    )
                },
                "counts": dict(self.counts),
            },
        )
        self.last_refresh = time.time()
        self.records_since = len(self.store.new)
        if manifest is not None:
            # Publish pending: commit the state after this refresh and the version about to
            # be published first, so that a kill from here until the next commit makes the
            # restart finish (or find) the publish instead of training these records again.
            self.pending = {"version": decision["version"], "manifest": manifest}
            self.commit()
            FAULT("refresh:pending")
            self._publish(student, manifest, version=decision["version"])
            FAULT("refresh:published")
            self.pending = None
        self.commit()
        return decision

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
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rollback":
        from specdistill.train.online.dirs import rollback_main

        return rollback_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="specdistill online",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--recipe", help="YAML recipe with an online: section")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="tail new shards and lines")
    mode.add_argument("--once", action="store_true", help="one pass over the traffic, then exit")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    follow = True if args.follow else False if args.once else None
    OnlineJob(recipe).run(follow=follow)
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
