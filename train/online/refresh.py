"""The online job's refresh: optimiser steps of the step core (train/step.py) on the new
records and replay, the gate against the served incumbent, maybe a publish, a commit."""

import math
import time

from specdistill.serve.drafts import Manifest


class Refreshes:
    """Mixed into OnlineJob (train/online/job.py): uses its recipe, store, step core, target,
    tokenizer, cursor, counts, faults, logs and the ServedVersions methods."""

    def refresh_batches(self, items: list[dict], sparse: bool):
        """The data order of a refresh on `items` (a new one each refresh), with the step
        core's target source set to match: the records' top_logprobs when `sparse`, else
        the live target."""
        from specdistill.data.dataset import TokenDataset
        from specdistill.train.batches import Batches
        from specdistill.train.online.traffic import RecordTargets, to_tokens
        from specdistill.train.targets import IndexedTargets
        from specdistill.train.temperatures import TrafficShares

        data = TokenDataset([to_tokens(it) for it in items], n_records=len(items), skipped={})
        core = self.core
        core.set_targets(IndexedTargets(RecordTargets(items), core.vocab_size) if sparse else None)
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
                ("loss.name", lo.name, "tau" not in (lo.name, *lo.params.get("parts", {}))),
                ("draft.type", r.draft.type, r.draft.type == "standalone"),
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
        from specdistill.train.online.gate import by_temperature, decide, sequence_alpha

        self._follow_external_change()
        r, o, core = self.recipe, self.o, self.core
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
        sparse = self.sparse_targets(items)
        batches = self.refresh_batches(items, sparse)
        one_pass = math.ceil(len(items) / g)
        steps = max(1, one_pass) if osd else max(o.refresh_steps, one_pass)
        losses = []
        for s in range(steps):  # the offline run's own step: loss, accumulation, clipping
            losses.append(core.train_step(batches.micro_batches(s)).loss)
            self.faults("refresh:step")
        student = core.draft_module()
        version, incumbent = self.incumbent()
        bad = [i for i, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:  # never served, whatever the policy
            verdict = {
                "promote": False,
                "why": f"the training loss is not finite ({losses[bad[0]]} at step {bad[0] + 1} "
                f"of {steps})",
                "n_heldout": len(self.store.holdout),
                "alpha_candidate": None,
                "alpha_incumbent": None,
            }
        elif osd:  # no gate: every update is served
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
            kind = core.kind
            cand = sequence_alpha(kind, self.target, student, held, pad) if held else []
            inc = sequence_alpha(kind, self.target, incumbent, held, pad) if held else []
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
        self.faults("refresh:gated")
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
            manifest = Manifest(
                reason="promoted",
                policy=o.policy,
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
            self.pending = {"version": decision["version"], "manifest": manifest.to_dict()}
            self.commit()
            self.faults("refresh:pending")
            self._publish(student, manifest, version=decision["version"])
            self.faults("refresh:published")
            self.pending = None
        self.commit()
        return decision
