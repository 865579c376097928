"""`specdistill speculate --engine vllm`: the sweep's prompts decoded again by vLLM, the engine
users deploy, beside this project's engine, number for number.

The draft is written as its `vllm` export (the writer its type contributes, drafts/export.py)
into a temporary directory; vLLM then decodes the same token-id prompts at each temperature,
once with the target alone and once per γ with the draft (eval/vllm_speculate.py), with as
many requests at once as the sweep's batch size. vLLM's own counters give the mean accepted
length and the acceptance at each draft position, which sit beside the project's
configuration of the same temperature and γ: its τ, its per-slot acceptance and the trainer's
τ_pred (from offline α on the same prompts). At T = 0 it counts the prompts whose output
equals vLLM's target alone, and the project's target alone. γ "auto" and "adaptive" have no
vLLM counterpart and are left out.

Both engines sample the draft's proposals from its distribution at the request's temperature
(vLLM's `draft_sample_method="probabilistic"`), so at T = 1 the two accept by the same rule;
a type whose export holds only for greedy proposals says so in its keys (a reduced-vocabulary
standalone draft: drafts/standalone/full_vocab.py), and vLLM then proposes its argmax.
vLLM decodes the last tokens of a request in rounds of their own, which the project's engine
folds into its last round: its τ comes out slightly lower on short answers.
"""

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from specdistill import drafts
from specdistill.drafts.export import Options
from specdistill.eval.vllm_engine import VllmError, VllmSettings
from specdistill.eval.vllm_speculate import VllmRun, VllmSpeculation
from specdistill.models import hub


class VllmEntry(BaseModel):
    """One (temperature, γ) configuration decoded by vLLM, beside the project's (report.json's
    `vllm` list)."""

    model_config = ConfigDict(extra="forbid")

    name: str  # the project's configuration it sits beside
    temperature: float
    gamma: int
    tau: float  # vLLM's mean accepted length: 1 + accepted drafts per round
    # P(position j accepted | positions < j accepted), as the project's `slot_acceptance`
    slot_acceptance: list[float | None]
    rounds: int
    tokens_per_s: float
    alone_tokens_per_s: float  # vLLM's target alone, same prompts, same run
    speedup: float
    ours_tau: float | None
    ours_slot_acceptance: list[float | None] | None
    ours_tokens_per_s: float | None
    ours_alone_tokens_per_s: float | None
    tau_pred: float | None  # the trainer's prediction from offline α
    identical_to_alone: int | None = None  # T = 0: prompts equal to vLLM's target alone
    equal_to_ours: int | None = None  # T = 0: prompts equal to this project's target alone
    prompts: int


def speculation_of(draft) -> Mapping[str, object]:
    """vLLM's speculative keys for the loaded `draft`'s type; VllmError when vLLM does not
    decode it."""
    kind = drafts.type_of(draft)
    can = kind.capabilities
    if "vllm" not in can.formats or not can.vllm_speculation:
        raise VllmError(
            f"vLLM does not decode a {kind.name} draft of this kind"
            + (f" ({can.format_note})" if can.format_note else "")
        )
    return can.vllm_speculation


def export_draft(draft, source: str, out: Path) -> Path:
    """`draft` (loaded from `source`) written as its `vllm` export into the new `out`."""
    kind = drafts.type_of(draft)
    directory = Path(source)
    options = Options(source=directory if directory.is_dir() else None)
    plan = kind.exports.writers["vllm"](draft, options)
    out.mkdir(parents=True)
    plan.write(out)
    return out


@dataclass(frozen=True)
class VllmRunSettings:
    """How vLLM decodes the sweep's prompts: the sweep's dtype, batch size (vLLM's most
    sequences at once), threads, seed and lengths; eager unless `compile`."""

    dtype: str = "float32"
    compile: bool = False
    batch_size: int = 1
    threads: int | None = None
    seed: int = 0
    max_new_tokens: int = 128
    eos_token_id: int | None = None

    def engine(self) -> VllmSettings:
        return VllmSettings(
            dtype=self.dtype,
            compile=self.compile,
            max_num_seqs=self.batch_size,
            threads=self.threads,
            seed=self.seed,
        )


def compare(
    target: str,
    draft,
    draft_source: str,
    prompt_ids: list[list[int]],
    result: dict,
    runs: dict,
    run: VllmRunSettings,
) -> list[VllmEntry]:
    """vLLM's entries beside the sweep's `result` (its configs) and `runs` (its generations by
    name) for the loaded `draft` (from `draft_source`) on `target` (any name the project
    loads: an embedded or registry model is its built directory)."""
    speculation = speculation_of(draft)
    configs = [c for c in result["configs"] if isinstance(c["gamma"], int)]
    if not configs:
        raise VllmError('--engine vllm compares fixed γ only: give --gamma numbers, not "auto"')
    target_dir = hub.local_model_dir(target) or target
    settings = run.engine()
    decode = dict(
        prompts=prompt_ids,
        temperatures=sorted({c["temperature"] for c in configs}),
        max_new_tokens=run.max_new_tokens,
        eos_token_id=run.eos_token_id,
    )
    entries = []
    with tempfile.TemporaryDirectory(prefix="specdistill-vllm-") as tmp:
        exported = export_draft(draft, draft_source, Path(tmp) / "draft")
        alone = _decode(VllmSpeculation(target_dir, settings), **decode)
        for gamma in sorted({c["gamma"] for c in configs}):
            engine = VllmSpeculation(
                target_dir, settings, draft=str(exported), speculation=speculation, gamma=gamma
            )
            with_draft = _decode(engine, **decode)
            for config in (c for c in configs if c["gamma"] == gamma):
                t = config["temperature"]
                entries.append(_entry(config, with_draft[t], alone[t], runs, result))
    return entries


def _decode(engine: VllmSpeculation, *, prompts, temperatures, **sampling) -> dict:
    """{temperature: VllmRun} of `engine` over `prompts`, after a short warm-up; closed."""
    try:
        engine.generate(prompts[:1], temperature=0.0, max_new_tokens=2, eos_token_id=None)
        return {t: engine.generate(prompts, temperature=t, **sampling) for t in temperatures}
    finally:
        engine.close()


def conditional(accepted: list[int], rounds: int) -> list[float | None]:
    """vLLM's accepted-at-position counts (position j accepted, so all before it) as the
    project's per-slot acceptance: P(j accepted | positions < j accepted)."""
    reached = [rounds, *accepted[:-1]]
    return [a / r if r else None for a, r in zip(accepted, reached, strict=True)]


def _entry(config: dict, run: VllmRun, alone: VllmRun, runs: dict, result: dict) -> VllmEntry:
    stats = run.stats
    rounds = stats.num_spec_steps
    accepted = stats.acceptance_histogram + [0] * (
        config["gamma"] - len(stats.acceptance_histogram)
    )
    ours_alone = _alone_run(result, runs, config["temperature"])
    entry = VllmEntry(
        name=config["name"],
        temperature=config["temperature"],
        gamma=config["gamma"],
        tau=stats.as_dict()["mean_acceptance_length"],
        slot_acceptance=conditional(accepted, rounds),
        rounds=rounds,
        tokens_per_s=run.tokens_per_s,
        alone_tokens_per_s=alone.tokens_per_s,
        speedup=run.tokens_per_s / alone.tokens_per_s,
        ours_tau=config.get("tau"),
        ours_slot_acceptance=config.get("slot_acceptance"),
        ours_tokens_per_s=config.get("tokens_per_s"),
        ours_alone_tokens_per_s=config.get("target_tokens_per_s"),
        tau_pred=config.get("tau_pred"),
        prompts=len(run.sequences),
    )
    if config["temperature"] == 0:
        entry.identical_to_alone = _same(run.sequences, alone.sequences)
        if ours_alone is not None:
            entry.equal_to_ours = _same(run.sequences, ours_alone.sequences)
    return entry


def _alone_run(result: dict, runs: dict, temperature: float):
    """The project's target-alone generation at `temperature`, if the sweep kept it."""
    baseline = result.get("baselines", {}).get(f"{temperature:g}")
    return runs.get(baseline["name"]) if baseline else None


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def _f(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _slots(values) -> str:
    return " / ".join(_f(v, 2) for v in values or []) or "–"


def markdown_lines(entries: list) -> list[str]:
    """report.md's section: each configuration in both engines, side by side (`VllmEntry`s
    or their dicts)."""
    if not entries:
        return []
    entries = [VllmEntry.model_validate(e) for e in entries]
    lines = [
        "",
        "## vLLM beside this engine",
        "",
        "The same prompts decoded by vLLM (`--engine vllm`, eval/vllm_compare.py) with the "
        "draft's vLLM export; τ is the mean accepted length (accepted drafts + 1 per round); "
        "per-slot acceptance is P(slot j accepted | slots before it accepted); tokens/s "
        "against each engine's own target alone; at T = 0, prompts whose output equals vLLM's "
        "target alone and this engine's.",
        "",
        "| config | τ vLLM | τ ours | τ_pred | slots vLLM | slots ours | vLLM tok/s (alone) "
        "| ours tok/s (alone) | greedy = vLLM alone | = ours alone |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        greedy = [
            "–" if n is None else f"{n}/{e.prompts}"
            for n in (e.identical_to_alone, e.equal_to_ours)
        ]
        lines.append(
            f"| {e.name} | {_f(e.tau)} | {_f(e.ours_tau)} | {_f(e.tau_pred)} "
            f"| {_slots(e.slot_acceptance)} | {_slots(e.ours_slot_acceptance)} "
            f"| {_f(e.tokens_per_s, 1)} ({_f(e.alone_tokens_per_s, 1)}) "
            f"| {_f(e.ours_tokens_per_s, 1)} ({_f(e.ours_alone_tokens_per_s, 1)}) "
            f"| {greedy[0]} | {greedy[1]} |"
        )
    return lines
