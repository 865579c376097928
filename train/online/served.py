"""The online job's side of ROOT (`online.drafts`): load a published version, the incumbent
the gate compares against, a `current` moved by someone else (a rollback), publishing a
promotion, and finishing a publish that a kill interrupted. A version that does not load is
reported (an ALERT, once, and a metric) and never stops the job."""

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdistill.drafts.checked_load import load_checked
from specdistill.formats.published import Manifest, read_current, read_manifest, version_draft_dir
from specdistill.models.embedded import resolve_model
from specdistill.publish import atomic_write_text
from specdistill.train.online.context import Context
from specdistill.train.online.versions import publish_version, versions


def initial_manifest() -> Manifest:
    """The manifest fields of the first version a job publishes: its starting draft."""
    return Manifest(reason="initial draft", records_trained=0)


@dataclass(eq=False)
class Served:
    """ROOT as the job sees it, through the shared `ctx` (ROOT, the target, the step core's
    running draft). Its own state: the version the running draft descends from
    (`known_current`) and a promotion being published (`pending`), both committed with the
    job's state; the incumbent loaded for the gate and the versions reported unloadable."""

    ctx: Context
    known_current: str | None = None
    pending: dict | None = None  # {"version", "manifest"}: a promotion being published
    _incumbent: tuple = field(default=(None, None), init=False)  # (version, model)
    _unloadable: set[str] = field(default_factory=set, init=False)  # reported once each

    def state(self) -> dict:
        """The served side's part of the committed state."""
        return {"known_current": self.known_current, "pending": self.pending}

    def load(self, state: dict) -> None:
        self.known_current = state["known_current"]
        self.pending = state.get("pending")

    def start(self) -> None:
        """A fresh start: publish the running draft as the first version, or start it from
        the version ROOT serves (a `current` lost between a first publish and its write is
        restored first)."""
        root = self.ctx.root
        current = read_current(root)
        left = versions(root)
        if current is None and left:  # killed between a first publish and its `current`
            atomic_write_text(root / "current", left[-1] + "\n")
            current = left[-1]
        student = self.ctx.core.draft_module()
        if current is None:
            version = self.publish(student, initial_manifest())
            self.ctx.print(f"online: published the initial draft as {version}")
        else:
            model = self._try_load_version(current)
            if model is not None:
                student.load_state_dict(model.state_dict())
                self.ctx.print(f"online: starting from the served version {current}")
            self.known_current = current

    def complete_pending(self) -> str:
        """The committed state is the one after a promoted refresh whose version was being
        published when the job died: finish that publish (or find it done), never train
        those records again. Returns what was done; the job commits."""
        root = self.ctx.root
        version = self.pending["version"]
        manifest = Manifest.from_dict(self.pending["manifest"])
        if (root / version / "manifest.json").is_file():
            current = read_current(root)
            if current != version and read_manifest(root / version).parent == current:
                atomic_write_text(root / "current", version + "\n")  # killed before this
            self.known_current = read_current(root)
            how = "found it published"
        else:
            self.publish(self.ctx.core.draft_module(), manifest, version=version)
            how = "published it now"
        self.pending = None
        return f"a publish of {version} was pending at the crash; {how}"

    def publish_promotion(
        self, model, manifest: Manifest, version: str, commit: Callable[[], None]
    ) -> None:
        """Publish pending: `commit` (the job's) the state after this refresh and the version
        about to be published first, so that a kill from here until the next commit makes
        the restart finish (or find) the publish instead of training these records again."""
        self.pending = {"version": version, "manifest": manifest.to_dict()}
        commit()
        self.ctx.faults("refresh:pending")
        self.publish(model, manifest, version=version)
        self.ctx.faults("refresh:published")
        self.pending = None

    # ----------------------------------------------------------------------------- versions
    def load_version(self, version: str):
        """The draft model of the published `version` (loaded and checked all or nothing)."""
        ctx = self.ctx
        model_dir = version_draft_dir(ctx.root, version)  # inside ROOT, or refused
        return load_checked(str(model_dir), ctx.target, ctx.tokenizer, dtype=ctx.recipe.draft.dtype)

    def _try_load_version(self, version: str):
        """The model of `version`, or None (an ALERT, once per version, and a metric) when it
        does not load: a broken version never stops the job."""
        try:
            return self.load_version(version)
        except Exception as e:  # noqa: BLE001 - whatever the reason, the version is unusable
            why = " ".join(str(e).split())[:600] or type(e).__name__
            if version not in self._unloadable:
                self._unloadable.add(version)
                self.ctx.print(
                    f"ALERT online: version {version} of {self.ctx.root} does not load "
                    f"({why}); the running draft is kept and no candidate is promoted over "
                    "it: roll back to a good version (specdistill online rollback)",
                    file=sys.stderr,
                )
                self.ctx.log(
                    "metrics.jsonl",
                    {
                        "kind": "version_unloadable",
                        "version": version,
                        "why": why,
                        "time": time.time(),
                    },
                )
            return None

    def incumbent(self):
        """(version, model) of what ROOT/current names now (model None: it does not load)."""
        current = read_current(self.ctx.root)
        if current is not None and self._incumbent[0] != current:
            model = self._try_load_version(current)
            self._incumbent = (current, None if model is None else model.eval())
        return self._incumbent

    def follow_external_change(self) -> None:
        """A rollback (or another publisher) moved `current`: the running draft restarts
        from the version now served."""
        current = read_current(self.ctx.root)
        if current is not None and current != self.known_current:
            model = self._try_load_version(current)
            if model is not None:
                self.ctx.core.draft_module().load_state_dict(model.state_dict())
            then = "the running draft restarts from it" if model is not None else "kept the draft"
            self.ctx.print(f"online: current moved {self.known_current} -> {current}; {then}")
            self.ctx.log(
                "metrics.jsonl",
                {
                    "kind": "external_change",
                    "from": self.known_current,
                    "to": current,
                    "time": time.time(),
                },
            )
            self.known_current = current

    def publish(self, model, manifest: Manifest, version: str | None = None) -> str:
        """Publish `model` as a new version (`version`: that name) and follow it."""
        ctx = self.ctx
        verifier = resolve_model(ctx.recipe.target.model)
        kind = ctx.core.kind
        manifest = dataclasses.replace(
            manifest,
            target={"name": ctx.recipe.target.model, "identity": ctx.identity},
            draft_type=kind.name,
        )
        version = publish_version(
            ctx.root,
            lambda d: kind.save(model, d, ctx.tokenizer, verifier=verifier),
            manifest,
            keep=ctx.online.keep_versions,
            version=version,
            faults=ctx.faults,
        )
        self.known_current = version
        return version
