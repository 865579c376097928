"""The online job's side of ROOT (`online.drafts`): load a published version, the incumbent
the gate compares against, a `current` moved by someone else (a rollback), publishing a
promotion, and finishing a publish that a kill interrupted. A version that does not load is
reported (an ALERT, once, and a metric) and never stops the job."""

import sys
import time

from specdistill.formats.published import Manifest, read_current, read_manifest, version_draft_dir


def initial_manifest() -> Manifest:
    """The manifest fields of the first version a job publishes: its starting draft."""
    return Manifest(reason="initial draft", records_trained=0)


class ServedVersions:
    """Mixed into OnlineJob (train/online/job.py): uses its root, recipe, target, tokenizer,
    step core, faults and logs."""

    def _complete_pending(self) -> None:
        """The committed state is the one after a promoted refresh whose version was being
        published when the job died: finish that publish (or find it done) and commit, never
        train those records again."""
        from specdistill.publish import atomic_write_text

        version = self.pending["version"]
        manifest = Manifest.from_dict(self.pending["manifest"])
        if (self.root / version / "manifest.json").is_file():
            current = read_current(self.root)
            if current != version and read_manifest(self.root / version).parent == current:
                atomic_write_text(self.root / "current", version + "\n")  # killed before this
            self.known_current = read_current(self.root)
            how = "found it published"
        else:
            self._publish(self.core.draft_module(), manifest, version=version)
            how = "published it now"
        self.pending = None
        self.commit()
        self.print(f"online: a publish of {version} was pending at the crash; {how}")

    # ----------------------------------------------------------------------------- versions
    def load_version(self, version: str):
        """The draft model of the published `version` (loaded and checked all or nothing)."""
        from specdistill.drafts.checked_load import load_checked

        model_dir = version_draft_dir(self.root, version)  # inside ROOT, or refused
        return load_checked(
            str(model_dir), self.target, self.tokenizer, dtype=self.recipe.draft.dtype
        )

    def _try_load_version(self, version: str):
        """The model of `version`, or None (an ALERT, once per version, and a metric) when it
        does not load: a broken version never stops the job."""
        try:
            return self.load_version(version)
        except Exception as e:  # noqa: BLE001 - whatever the reason, the version is unusable
            why = " ".join(str(e).split())[:600] or type(e).__name__
            if version not in self._said:
                self._said.add(version)
                self.print(
                    f"ALERT online: version {version} of {self.root} does not load ({why}); "
                    "the running draft is kept and no candidate is promoted over it: roll "
                    "back to a good version (specdistill online rollback)",
                    file=sys.stderr,
                )
                self._log(
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
        current = read_current(self.root)
        if current is not None and self._incumbent[0] != current:
            model = self._try_load_version(current)
            self._incumbent = (current, None if model is None else model.eval())
        return self._incumbent

    def _follow_external_change(self) -> None:
        """A rollback (or another publisher) moved `current`: the running draft restarts
        from the version now served."""
        current = read_current(self.root)
        if current is not None and current != self.known_current:
            model = self._try_load_version(current)
            if model is not None:
                self.core.draft_module().load_state_dict(model.state_dict())
            then = "the running draft restarts from it" if model is not None else "kept the draft"
            self.print(f"online: current moved {self.known_current} -> {current}; {then}")
            self._log(
                "metrics.jsonl",
                {
                    "kind": "external_change",
                    "from": self.known_current,
                    "to": current,
                    "time": time.time(),
                },
            )
            self.known_current = current

    def _publish(self, model, manifest: Manifest, version: str | None = None) -> str:
        import dataclasses

        from specdistill.drafts.embedded import resolve_model
        from specdistill.train.online.versions import publish_version

        verifier = resolve_model(self.recipe.target.model)
        kind = self.core.kind
        manifest = dataclasses.replace(
            manifest,
            target={"name": self.recipe.target.model, "identity": self.identity},
            draft_type=kind.name,
        )
        version = publish_version(
            self.root,
            lambda d: kind.save(model, d, self.tokenizer, verifier=verifier),
            manifest,
            keep=self.o.keep_versions,
            version=version,
            faults=self.faults,
        )
        self.known_current = version
        return version
