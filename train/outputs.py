"""The offline run's published outputs: final/ and best/ (the draft in its serving format,
with the acceptance head it carries) and eval.json, each written atomically
(specdistill/publish.py `publish_dir`)."""

import copy
import json
import shutil
from pathlib import Path

from specdistill.drafts.acceptance_head import attach_head, attached_head
from specdistill.models.embedded import resolve_model
from specdistill.publish import atomic_write_text, publish_dir
from specdistill.train.run_plan import quiet_library_bars


class Outputs:
    """Publishes drafts of the run of `recipe` (draft type `kind`, `tokenizer`) into `out`."""

    def __init__(self, recipe, out: Path, kind, tokenizer):
        self.recipe, self.out, self.kind, self.tokenizer = recipe, Path(out), kind, tokenizer

    def publish_draft(self, draft, dest: Path, *, merged_copy: bool = False) -> None:
        """Save `draft` in its serving format at `dest`, atomically (publish_dir), with the
        acceptance head it carries (the draft type's `save` writes the head's files). A LoRA
        draft is saved merged, its head attached to the merged model; `merged_copy` merges a
        copy, leaving the trained one as it is."""
        if self.recipe.draft.lora.r > 0:
            head = attached_head(draft)
            draft = (copy.deepcopy(draft) if merged_copy else draft).merge_and_unload()
            attach_head(draft, head)
        # The verifier as serving engines can load it (an embedded target: its local directory).
        verifier = resolve_model(self.recipe.target.model)
        tmp = self.out / f".tmp-{dest.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with quiet_library_bars():
                self.kind.save(draft, tmp, self.tokenizer, verifier=verifier)
            publish_dir(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def publish_best(self, draft) -> None:
        self.publish_draft(draft, self.out / "best", merged_copy=True)

    def save_final(self, draft, result: dict, *, copy_to_best: bool = False) -> None:
        """final/ (and best/ too when the final evaluation is the best), then eval.json."""
        report = self.out / "eval.json"
        # eval.json marks the run complete (prepare_output_dir): it must never describe a
        # final/ other than the one beside it, so it goes first and comes back last.
        report.unlink(missing_ok=True)
        self.publish_draft(draft, self.out / "final")
        if copy_to_best:  # the same files: copied, not serialised (and merged) a second time
            tmp = self.out / ".tmp-best"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                shutil.copytree(self.out / "final", tmp)
                publish_dir(tmp, self.out / "best")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        atomic_write_text(report, json.dumps(result, indent=1))
