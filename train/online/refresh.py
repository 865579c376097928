"""The online job's refresh: optimiser steps of the step core (train/step.py) on the new
records and replay, the gate against the served incumbent, maybe a publish, a commit."""

import math
import time

from specdistill.formats.published import Manifest
from specdistill.train.online.kept import KeptRecord


class Refreshes:
    """Mixed into OnlineJob (train/online/job.py): uses its recipe, store, step core, target,
    tokenizer, cursor, counts, faults, logs and the ServedVersions methods."""

    def refresh_batches(self, items: list[KeptRecord], sparse: bool):
        """The data order of a refresh on `items` (a new one each refresh), with the step
        core's target source set to match: the records' top_logprobs when `sparse`, else
        the live target."""
        from specdistill.data.dataset import TokenDataset
        from specdistill.train.batches import Batches
        from specdistill.train.online.sparse import RecordTargets
        from specdistill.train.targets import IndexedTargets
        from specdistill.train.temperatures import TrafficShares

        data = TokenDataset([it.tokens() for it in items], n_records=len(items), skipped={})
        core = self.core
        core.set_targets(
            IndexedTargets(RecordTargets(items, core.kind), core.vocab_size) if sparse else None
        )
        # loss.temperature=traffic: each record at the temperature and top-p it was served with
        traffic = self.recipe.loss.temperature == "traffic"
        core.set_sampling(TrafficShares(items) if traffic else None)
        batches = Batches(
            data,
            recipe=self.recipe,
            accelerator=core.accelerator,
            pad_token_id=self.tokenizer.pad_token_id,
            indexed=sparse or traffic,
        )
        if self.on_policy is not None:
            batches.use_on_policy(self.on_policy)
        return batches

    def due(self, final: bool = False) -> bool:
        n = len(self.store.new)
        if n >= self.o.refresh_records:
            return True
        if n >= self.o.min_refresh_records:
            return final or time.time() - self.last_refresh >= self.o.refresh_seconds
        return False

    def sparse_targets(self, items: list[KeptRecord]) -> bool:
        """Whether a refresh on `items` trains on their top_logprobs (online.sparse_targets):
        every record carries them and the loss can compare a rest bin."""
        r = self.recipe
        if not (r.online.sparse_targets and all(it.top_logprobs for it in items)):
            return False
        lo = r.loss
        why = [
            f"{key}={value}"
            for key, value, fine in (
                ("loss.temperature", lo.temperature, lo.temperature == 1.0),
                ("loss.top_p", lo.params.get("top_p"), lo.params.get("top_p") is None),
                ("loss.top_k", lo.params.get("top_k"), lo.params.get("top_k") is None),
                ("loss.chunk_size", lo.chunk_size, lo.chunk_size is None),
                ("loss.name", lo.name, self.core.objective.loss.chain is None),
                ("draft.type", r.draft.type, self.core.kind.capabilities.sparse_targets),
                (  # the acceptance head's label is α at eval.temperature
                    "eval.temperature",
                    r.eval.temperature,
                    not r.acceptance_head.enabled or r.eval.temperature == 1.0,
                ),
            )
            if not fine
        ]
        if why and not getattr(self, "_said_sparse", False):
            self._said_sparse = True
            self.print(
                "online: the records carry top_logprobs, but the refreshes run the target: "
                f"sparse targets need loss temperature 1, unfiltered, unchunked, a standalone "
                f"draft, and eval.temperature 1 for an acceptance head ({', '.join(why)})"
            )
        return not why

    def refresh(self) -> dict:
        """K optimiser steps on the new records + replay, the gate, maybe a publish, commit.
        A step that diverges stops the job (the step core's `TrainingDiverged`) before
        anything is committed or published; a non-finite loss that reaches the gate is a
        rejection under every policy."""
        self._follow_external_change()
        fresh, replay = self._refresh_items()
        items = fresh + replay
        sparse = self.sparse_targets(items)
        losses = self._train(items, sparse)
        student = self.core.draft_module()
        version, incumbent = self.incumbent()
        verdict = self._verdict(losses, student, version, incumbent)
        self.refreshes += 1
        decision = {
            "refresh": self.refreshes,
            "time": time.time(),
            "decision": "promoted" if verdict["promote"] else "rejected",
            "why": verdict["why"],
            "incumbent": version,
            "steps": len(losses),
            "loss": sum(losses) / len(losses),
            "records_new": len(fresh),
            "records_replay": len(replay),
            "target": "records' top_logprobs" if sparse else "live",
            **{k: v for k, v in verdict.items() if k not in ("promote", "why")},
        }
        self.faults("refresh:gated")
        manifest = self._promotion(verdict, decision, fresh) if verdict["promote"] else None
        self._log("decisions.jsonl", decision)
        self.print(refresh_line(self.refreshes, decision, len(fresh), len(replay)))
        self._count_trained(fresh, verdict["promote"])
        self._log("metrics.jsonl", self._refresh_metric(decision))
        self.last_refresh = time.time()
        self.records_since = len(self.store.new)
        if manifest is not None:
            self._publish_promotion(student, manifest, decision["version"])
        self.commit()
        return decision

    def _refresh_items(self) -> tuple[list[KeptRecord], list[KeptRecord]]:
        """(new records, replay) of this refresh: under OSD (arXiv 2310.07177) the new
        records once and no replay, else the store's mix."""
        r, o = self.recipe, self.o
        if o.policy == "osd":
            return self.store.new_items(), []
        return self.store.refresh_mix(
            o.refresh_steps * r.train.global_batch_size,
            o.recent_ratio,
            o.anchor_ratio,
            seed=r.train.seed * 7919 + self.refreshes,
        )

    def _train(self, items: list[KeptRecord], sparse: bool) -> list[float]:
        """The refresh's optimiser steps (the offline run's own step: loss, accumulation,
        clipping): one pass over `items` at least, `online.refresh_steps` at least unless
        OSD. Returns each step's loss."""
        batches = self.refresh_batches(items, sparse)
        one_pass = math.ceil(len(items) / self.recipe.train.global_batch_size)
        if self.o.policy == "osd":
            steps = max(1, one_pass)
        else:
            steps = max(self.o.refresh_steps, one_pass)
        losses = []
        for s in range(steps):
            losses.append(self.core.train_step(batches.micro_batches(s)).loss)
            self.faults("refresh:step")
        return losses

    def _verdict(self, losses: list[float], student, version, incumbent) -> dict:
        """Promote or not, and why: never a non-finite loss, always under OSD (no gate),
        never over a served version that does not load; else the gate's decision."""
        bad = [i for i, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:  # never served, whatever the policy
            why = (
                f"the training loss is not finite ({losses[bad[0]]} at step {bad[0] + 1} "
                f"of {len(losses)})"
            )
            return ungated(False, why, len(self.store.holdout))
        if self.o.policy == "osd":  # no gate: every update is served
            return ungated(True, "osd policy: no gate, promote always", 0)
        if version is not None and incumbent is None:
            why = f"the served version {version} does not load: roll back to a good one"
            return ungated(False, why, len(self.store.holdout))
        return self._gate(student, incumbent)

    def _gate(self, student, incumbent) -> dict:
        """The gate (train/online/gate.py) on the held-out slice: candidate against the
        incumbent, per sequence, and α by the temperature each was served at."""
        from specdistill.train.online.gate import by_temperature, decide, sequence_alpha

        held = list(self.store.holdout)
        pad = self.tokenizer.pad_token_id
        kind = self.core.kind
        cand = sequence_alpha(kind, self.target, student, held, pad) if held else []
        inc = sequence_alpha(kind, self.target, incumbent, held, pad) if held else []
        seed = self.recipe.train.seed + self.refreshes
        verdict = decide(cand, inc, [it.category for it in held], self.o, seed=seed)
        if held:
            verdict["by_temperature"] = by_temperature(cand, inc, [it.temperature for it in held])
        return verdict

    def _promotion(self, verdict: dict, decision: dict, fresh: list[KeptRecord]) -> Manifest:
        """The manifest of the version a promotion publishes; its name goes into
        `decision["version"]` (ROOT's leftovers removed first)."""
        from specdistill.publish import remove_leftovers
        from specdistill.train.online.versions import next_version

        window = [min(it.time for it in fresh), max(it.time for it in fresh)] if fresh else None
        remove_leftovers(self.root)
        decision["version"] = next_version(self.root)
        return Manifest(
            reason="promoted",
            policy=self.o.policy,
            traffic_window=window,
            records_trained=len(self.trained_ids) + len(fresh),
            alpha=verdict["alpha_candidate"],
            alpha_incumbent=verdict["alpha_incumbent"],
            delta=verdict.get("delta"),
            ci=verdict.get("ci"),
            confidence=verdict.get("confidence"),
            loss=decision["loss"],
            cursor=self.cursor.as_dict(),
        )

    def _count_trained(self, fresh: list[KeptRecord], promoted: bool) -> None:
        self.store.mark_trained(it.id for it in fresh)
        self.trained_ids.extend(it.id for it in fresh)
        self.counts["records_trained"] += len(fresh)
        self.counts["promotions" if promoted else "rejections"] += 1

    def _refresh_metric(self, decision: dict) -> dict:
        """The refresh's line of OUT/metrics.jsonl, with the job's counts."""
        keys = (
            "refresh",
            "time",
            "decision",
            "loss",
            "records_new",
            "alpha_candidate",
            "alpha_incumbent",
        )
        return {"kind": "refresh", **{k: decision[k] for k in keys}, "counts": dict(self.counts)}

    def _publish_promotion(self, student, manifest: Manifest, version: str) -> None:
        """Publish pending: commit the state after this refresh and the version about to be
        published first, so that a kill from here until the next commit makes the restart
        finish (or find) the publish instead of training these records again."""
        self.pending = {"version": version, "manifest": manifest.to_dict()}
        self.commit()
        self.faults("refresh:pending")
        self._publish(student, manifest, version=version)
        self.faults("refresh:published")
        self.pending = None


def ungated(promote: bool, why: str, n_heldout: int) -> dict:
    """A verdict reached without comparing the drafts."""
    return {
        "promote": promote,
        "why": why,
        "n_heldout": n_heldout,
        "alpha_candidate": None,
        "alpha_incumbent": None,
    }


def refresh_line(n: int, decision: dict, n_new: int, n_replayed: int) -> str:
    """What a refresh prints: its decision and loss, and α by temperature when the held-out
    slice has several."""
    line = (
        f"online refresh {n}: {decision['decision']} ({decision['why']}); loss "
        f"{decision['loss']:.4f}, {n_new} new + {n_replayed} replayed records"
    )
    if "version" in decision:
        line += f" -> {decision['version']}"
    by_temperature = decision.get("by_temperature") or {}
    if len(by_temperature) > 1:
        line += "; alpha by temperature (incumbent -> candidate): " + ", ".join(
            f"T={t} {v['alpha_incumbent']:.3f} -> {v['alpha_candidate']:.3f}"
            for t, v in by_temperature.items()
        )
    return line
