"""The online job's refresh: optimiser steps of the step core (train/step.py) on the new
records and replay, the gate against the served incumbent, the decision logged; the job
(train/online/job.py) publishes a promotion (train/online/served.py) and commits."""

import math
import threading
import time
from dataclasses import dataclass, field

from specdistill.data.dataset import TokenDataset
from specdistill.formats.published import Manifest
from specdistill.publish import remove_leftovers
from specdistill.train.batches import Batches
from specdistill.train.on_policy import OnPolicy
from specdistill.train.online import gate  # looked up at each call: a test wraps sequence_alpha
from specdistill.train.online.context import Context
from specdistill.train.online.kept import KeptRecord
from specdistill.train.online.served import Served
from specdistill.train.online.sparse import RecordTargets
from specdistill.train.online.versions import next_version
from specdistill.train.targets import IndexedTargets
from specdistill.train.temperatures import TrafficShares


@dataclass(eq=False)
class Refresh:
    """Refreshes of the running draft (`ctx.core`) on the shared store, gated against the
    incumbent that `served` loads. Its own state: the refreshes run and the ids of the
    records trained (committed with the job's state), the time of the last refresh, the
    on-policy generator (data.on_policy) and whether the sparse-targets notice was given."""

    ctx: Context
    served: Served  # the incumbent (`Served.incumbent`), read after the steps
    refreshes: int = 0
    trained_ids: list[str] = field(default_factory=list)
    last_refresh: float = field(default_factory=time.time)
    on_policy: OnPolicy | None = field(init=False)
    requested: threading.Event = field(default_factory=threading.Event)  # `request`: run one
    _said_sparse: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        """The generator of data.on_policy rows (train/on_policy.py), as the offline run's."""
        r, core = self.ctx.recipe, self.ctx.core
        self.on_policy = None
        if r.data.on_policy.fraction > 0:
            self.on_policy = OnPolicy(
                r,
                target=core.target,
                draft=core.draft_module(),
                tokenizer=self.ctx.tokenizer,
                vocab_size=core.vocab_size,
                device=core.accelerator.device,
            )

    def state(self) -> dict:
        """The refreshes' part of the committed state."""
        return {"trained_ids": self.trained_ids, "refreshes": self.refreshes}

    def load(self, state: dict) -> None:
        self.trained_ids = state["trained_ids"]
        self.refreshes = state["refreshes"]

    def refresh_batches(self, items: list[KeptRecord], sparse: bool) -> Batches:
        """The data order of a refresh on `items` (a new one each refresh), with the step
        core's target source set to match: the records' top_logprobs when `sparse`, else
        the live target."""
        r, core = self.ctx.recipe, self.ctx.core
        data = TokenDataset([it.tokens() for it in items], n_records=len(items), skipped={})
        core.set_targets(
            IndexedTargets(RecordTargets(items, core.kind), core.vocab_size) if sparse else None
        )
        # loss.temperature=traffic: each record at the temperature and top-p it was served with
        traffic = r.loss.temperature == "traffic"
        core.set_sampling(TrafficShares(items) if traffic else None)
        batches = Batches(
            data,
            recipe=r,
            accelerator=core.accelerator,
            pad_token_id=self.ctx.tokenizer.pad_token_id,
            indexed=sparse or traffic,
        )
        if self.on_policy is not None:
            batches.use_on_policy(self.on_policy)
        return batches

    def due(self, final: bool = False) -> bool:
        o = self.ctx.online
        n = len(self.ctx.store.new)
        if n >= o.refresh_records:
            return True
        if n >= o.min_refresh_records:
            if self.requested.is_set():
                return True
            return final or time.time() - self.last_refresh >= o.refresh_seconds
        return False

    def request(self) -> None:
        """Run a refresh as soon as online.min_refresh_records new records wait (a drop in
        served acceptance, seen by whoever watches the engine, asks for it)."""
        self.requested.set()

    def sparse_targets(self, items: list[KeptRecord]) -> bool:
        """Whether a refresh on `items` trains on their top_logprobs (online.sparse_targets):
        every record carries them and the loss can compare a rest bin."""
        r, core = self.ctx.recipe, self.ctx.core
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
                ("loss.name", lo.name, core.objective.loss.chain is None),
                ("draft.type", r.draft.type, core.kind.capabilities.sparse_targets),
                (  # the acceptance head's label is α at eval.temperature
                    "eval.temperature",
                    r.eval.temperature,
                    not r.acceptance_head.enabled or r.eval.temperature == 1.0,
                ),
            )
            if not fine
        ]
        if why and not self._said_sparse:
            self._said_sparse = True
            self.ctx.print(
                "online: the records carry top_logprobs, but the refreshes run the target: "
                f"sparse targets need loss temperature 1, unfiltered, unchunked, a standalone "
                f"draft, and eval.temperature 1 for an acceptance head ({', '.join(why)})"
            )
        return not why

    def run(self, cursor: dict) -> tuple[dict, Manifest | None]:
        """K optimiser steps on the new records + replay, the gate, the decision logged and
        counted: (the decision, the manifest of the version to publish when promoted; its
        name is `decision["version"]`). `cursor`: the traffic position, for the manifest.
        A step that diverges stops the job (the step core's `TrainingDiverged`) before
        anything is committed or published; a non-finite loss that reaches the gate is a
        rejection under every policy."""
        ctx = self.ctx
        self.requested.clear()
        fresh, replay = self._refresh_items()
        items = fresh + replay
        sparse = self.sparse_targets(items)
        losses = self._train(items, sparse)
        student = ctx.core.draft_module()
        version, incumbent = self.served.incumbent()
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
        ctx.faults("refresh:gated")
        manifest = None
        if verdict["promote"]:
            manifest = self._promotion(verdict, decision, fresh, cursor)
        ctx.log("decisions.jsonl", decision)
        ctx.print(refresh_line(self.refreshes, decision, len(fresh), len(replay)))
        self._count_trained(fresh, verdict["promote"])
        ctx.log("metrics.jsonl", self._refresh_metric(decision))
        self.last_refresh = time.time()
        return decision, manifest

    def _refresh_items(self) -> tuple[list[KeptRecord], list[KeptRecord]]:
        """(new records, replay) of this refresh: under OSD (arXiv 2310.07177) the new
        records once and no replay, else the store's mix."""
        r, o, store = self.ctx.recipe, self.ctx.online, self.ctx.store
        if o.policy == "osd":
            return store.new_items(), []
        return store.refresh_mix(
            o.refresh_steps * r.train.global_batch_size,
            o.recent_ratio,
            o.anchor_ratio,
            seed=r.train.seed * 7919 + self.refreshes,
        )

    def _train(self, items: list[KeptRecord], sparse: bool) -> list[float]:
        """The refresh's optimiser steps (the offline run's own step: loss, accumulation,
        clipping): one pass over `items` at least, `online.refresh_steps` at least unless
        OSD. Returns each step's loss."""
        o = self.ctx.online
        batches = self.refresh_batches(items, sparse)
        one_pass = math.ceil(len(items) / self.ctx.recipe.train.global_batch_size)
        if o.policy == "osd":
            steps = max(1, one_pass)
        else:
            steps = max(o.refresh_steps, one_pass)
        losses = []
        for s in range(steps):
            losses.append(self.ctx.core.train_step(batches.micro_batches(s)).loss)
            self.ctx.faults("refresh:step")
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
            return ungated(False, why, len(self.ctx.store.holdout))
        if self.ctx.online.policy == "osd":  # no gate: every update is served
            return ungated(True, "osd policy: no gate, promote always", 0)
        if version is not None and incumbent is None:
            why = f"the served version {version} does not load: roll back to a good one"
            return ungated(False, why, len(self.ctx.store.holdout))
        return self._gate(student, incumbent)

    def _gate(self, student, incumbent) -> dict:
        """The gate (train/online/gate.py) on the held-out slice: candidate against the
        incumbent, per sequence, and α by the temperature each was served at."""
        ctx = self.ctx
        held = list(ctx.store.holdout)
        pad = ctx.tokenizer.pad_token_id
        kind = ctx.core.kind
        cand = gate.sequence_alpha(kind, ctx.target, student, held, pad) if held else []
        inc = gate.sequence_alpha(kind, ctx.target, incumbent, held, pad) if held else []
        seed = ctx.recipe.train.seed + self.refreshes
        verdict = gate.decide(cand, inc, [it.category for it in held], ctx.online, seed=seed)
        if held:
            temperatures = [it.temperature for it in held]
            verdict["by_temperature"] = gate.by_temperature(cand, inc, temperatures)
        return verdict

    def _promotion(
        self, verdict: dict, decision: dict, fresh: list[KeptRecord], cursor: dict
    ) -> Manifest:
        """The manifest of the version a promotion publishes; its name goes into
        `decision["version"]` (ROOT's leftovers removed first)."""
        window = [min(it.time for it in fresh), max(it.time for it in fresh)] if fresh else None
        remove_leftovers(self.ctx.root)
        decision["version"] = next_version(self.ctx.root)
        return Manifest(
            reason="promoted",
            policy=self.ctx.online.policy,
            traffic_window=window,
            records_trained=len(self.trained_ids) + len(fresh),
            alpha=verdict["alpha_candidate"],
            alpha_incumbent=verdict["alpha_incumbent"],
            delta=verdict.get("delta"),
            ci=verdict.get("ci"),
            confidence=verdict.get("confidence"),
            loss=decision["loss"],
            cursor=cursor,
        )

    def _count_trained(self, fresh: list[KeptRecord], promoted: bool) -> None:
        self.ctx.store.mark_trained(it.id for it in fresh)
        self.trained_ids.extend(it.id for it in fresh)
        self.ctx.counts["records_trained"] += len(fresh)
        self.ctx.counts["promotions" if promoted else "rejections"] += 1

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
        counts = dict(self.ctx.counts)
        return {"kind": "refresh", **{k: decision[k] for k in keys}, "counts": counts}


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
