"""A run's evaluations of the draft on held-out data: acceptance α per temperature, the
predicted rounds τ_pred on the target's own continuations (τ texts), τ_pred from the draft's
own chains on prompts from outside the training data (eval.prompts), real speculative
decoding (measured τ and speedup per γ), and the calibration of the acceptance head the run
trains (ECE and a reliability diagram)."""

import json
from pathlib import Path

import torch
from accelerate.utils import gather_object

from specdistill.errors import UserError
from specdistill.eval.calibration import CalibrationReport, calibration, reliability_diagram
from specdistill.eval.chain_tau import chain_tau_pred
from specdistill.eval.offline import acceptance_sums, held_out_texts, summarise, tau_rounds_pred
from specdistill.eval.prompt_source import source_prompt_ids
from specdistill.eval.sweep import Settings, sweep
from specdistill.publish import atomic_write_text
from specdistill.train.batches import Batches
from specdistill.train.config import recipe_to_dict
from specdistill.train.step import DistillStep
from specdistill.train.temperatures import is_mixture, mixture

TAU_TEXTS = "tau_texts.json"
PROMPT_TEXTS = "prompt_texts.json"  # the target's continuations of eval.prompts
RELIABILITY_PNG = "acceptance_head_reliability.png"


def eval_record(step: int, metrics: dict) -> dict:
    """An evaluation as a metrics.jsonl line: keys eval/<name>, per γ and per depth spread."""
    record = {"step": step}
    for key, value in metrics.items():
        if key == "mixture":  # loss.temperature's distribution: eval/mixture_alpha, ...
            record["eval/mixture_alpha"] = value["alpha"]
            record.update({f"eval/mixture_tau_pred_{g}": t for g, t in value["tau_pred"].items()})
        elif key == "tau_domains":  # where each tau_pred comes from: words, not a metric
            continue
        elif key.startswith("tau_pred") and isinstance(value, dict):  # tau_pred, tau_pred_iid
            record.update({f"eval/{key}_{g}": t for g, t in value.items()})
        elif isinstance(value, list):  # per depth (eagle3): eval/alpha_depth_0, ...
            record.update({f"eval/{key}_{k}": v for k, v in enumerate(value)})
        else:
            record[f"eval/{key}"] = value
    return record


class Evaluator:
    """Evaluates `core`'s draft on the held-out set `held` (train/batches.py), and on
    eval.prompts (encoded with `tokenizer`) when the recipe names them. τ texts are kept in
    `out`/tau_texts.json (and prompt_texts.json), so that a resumed run measures on the same
    texts."""

    def __init__(self, recipe, core: DistillStep, held: Batches, out: Path, tokenizer):
        self.recipe, self.core, self.held, self.out = recipe, core, held, Path(out)
        self.data = held.dataset
        self._tau_texts: tuple[list, list] | None = None  # (prompts, target's outputs)
        self._prompt_texts: tuple[list, list] | None = None  # the same for eval.prompts
        self._mixture_texts: dict[float, list] = {}  # other temperatures' outputs
        self.prompt_ids = outside_prompts(recipe, core.kind, tokenizer, core.target)

    def batches(self) -> list[dict]:
        return self.held.held_out(self.recipe.eval.max_sequences)

    def evaluate(self) -> dict:
        core, e = self.core, self.recipe.eval
        acc = core.accelerator
        core.draft.eval()
        sums = acceptance_sums(
            core.kind, core.target, core.draft, self.batches(), temperature=e.temperature
        )
        tau = None
        if e.tau_prompts > 0:
            prompts, outputs = self.tau_texts()
            tau = tau_rounds_pred(
                core.target,
                core.draft_module(),
                prompts,
                outputs,
                temperature=e.temperature,
                max_gamma=e.max_gamma,
            )
        chain = self.chain_tau() if self.prompt_ids else None
        sums = acc.reduce(sums.to(acc.device), "sum").cpu()
        result = summarise(
            sums, temperature=e.temperature, max_gamma=e.max_gamma, tau_rounds=tau, tau_chains=chain
        )
        if self.prompt_ids:
            result["tau_domains"] = self.domains()
        if is_mixture(self.recipe.loss.temperature):
            result["mixture"] = self.mixture(result)
        core.train_mode()
        return result

    def chain_tau(self) -> dict[int, float]:
        """τ_pred from the draft's own chains along the target's continuations of
        eval.prompts, round-aware (eval/chain_tau.py), at eval.temperature; one seed for every
        evaluation, so that before and after are scored alike."""
        core, e = self.core, self.recipe.eval
        prompts, outputs = self.prompt_texts()
        chain = chain_tau_pred(
            core.kind,
            core.target,
            core.draft_module(),
            prompts,
            outputs,
            temperature=e.temperature,
            max_gamma=e.max_gamma,
            seed=self.recipe.train.seed,
        )
        return chain.rounds

    def domains(self) -> dict[str, str]:
        """eval.json's `tau_domains`: the text each tau_pred figure comes from."""
        e, data = self.recipe.eval, self.recipe.data
        held = (
            f"data.eval ({', '.join(data.eval)})"
            if data.eval
            else f"the held-out split of data.train ({', '.join(data.train)})"
        )
        iid = f"held-out text of {held}, teacher-forced"
        n = min(e.tau_prompts, len(self.data))
        rounds = f"the target's continuations of {n} held-out prompts of {held}" if n else iid
        chain = (
            f"eval.prompts ({e.prompts}): the draft's own chains along the target's "
            f"continuations of {len(self.prompt_ids)} prompts"
        )
        return {"tau_pred_iid": iid, "tau_pred": rounds, "tau_pred_chain": chain}

    def at_temperature(self, temperature: float) -> dict:
        """α and tau_pred at another temperature than eval.temperature (draft in eval mode)."""
        core, e = self.core, self.recipe.eval
        sums = acceptance_sums(
            core.kind, core.target, core.draft, self.batches(), temperature=temperature
        )
        tau = None
        if e.tau_prompts > 0:
            prompts, _ = self.tau_texts()
            if temperature not in self._mixture_texts:
                self._mixture_texts[temperature] = held_out_texts(
                    core.target,
                    prompts,
                    temperature=temperature,
                    max_new_tokens=e.tau_tokens,
                    seed=self.recipe.train.seed,
                )
            tau = tau_rounds_pred(
                core.target,
                core.draft_module(),
                prompts,
                self._mixture_texts[temperature],
                temperature=temperature,
                max_gamma=e.max_gamma,
            )
        sums = core.accelerator.reduce(sums.to(core.accelerator.device), "sum").cpu()
        return summarise(sums, temperature=temperature, max_gamma=e.max_gamma, tau_rounds=tau)

    def mixture(self, at_eval: dict) -> dict:
        """α and tau_pred at loss.temperature's distribution of served temperatures: each
        temperature's (the τ texts generated at that temperature, as eval.temperature's are),
        weighted. eval.json's `mixture`: {temperatures, alpha, alpha_by_temperature, tau_pred}."""
        weights = mixture(self.recipe.loss.temperature)
        each = {
            t: at_eval if t == self.recipe.eval.temperature else self.at_temperature(t)
            for t in weights
        }
        gammas = set.intersection(*(set(r["tau_pred"]) for r in each.values()))
        return {
            "temperatures": {f"{t:g}": w for t, w in weights.items()},
            "alpha": sum(w * each[t]["alpha"] for t, w in weights.items()),
            "alpha_by_temperature": {f"{t:g}": each[t]["alpha"] for t in weights},
            "tau_pred": {
                g: sum(w * each[t]["tau_pred"][g] for t, w in weights.items())
                for g in sorted(gammas)
            },
        }

    def head_calibration(self) -> CalibrationReport | None:
        """The trained acceptance head's predictions against their label (α at
        eval.temperature, from the live target) at depth 0 of the held-out batches, over
        every process's positions; None when the run trains no head."""
        core = self.core
        head = core.head_training
        if head is None:
            return None
        core.draft.eval()
        head.head.eval()
        pairs = []
        with torch.no_grad():
            for batch in self.batches():
                with head.inputs(core.draft_module()) as recorded:
                    d_logits, t_logits, masks = core.kind.depths(core.draft, core.target, batch)
                part = head.loss(recorded, d_logits, t_logits, masks, core.vocab_map())
                keep = masks[0].bool()
                pairs.append((part.predicted[0][keep].cpu(), part.labels[0][keep].cpu()))
        head.head.train()
        core.train_mode()
        if core.accelerator.num_processes > 1:
            pairs = gather_object(pairs)
        predicted = torch.cat([p for p, _ in pairs])
        labels = torch.cat([label for _, label in pairs]).clamp(0.0, 1.0)
        return calibration(predicted, labels)

    def head_entry(self) -> dict:
        """eval.json's `acceptance_head` entry, {"acceptance_head": {ece, n, bins,
        reliability_png}}, with the reliability diagram written beside it
        (`acceptance_head_reliability.png`, main process); {} when the run trains no head.
        Every process calls it."""
        report = self.head_calibration()
        if report is None:
            return {}
        if self.core.accelerator.is_main_process:
            reliability_diagram(report, self.out / RELIABILITY_PNG, title="acceptance head")
        entry = report.to_dict()
        keys = ("ece", "n", "bins")
        return {
            "acceptance_head": {**{k: entry[k] for k in keys}, "reliability_png": RELIABILITY_PNG}
        }

    def tau_texts(self) -> tuple[list[list[int]], list[list[int]]]:
        """The target's continuations of the first eval.tau_prompts held-out sequences (cut
        to eval.tau_prompt_tokens), eval.tau_tokens each, at eval.temperature: generated once
        per run, kept in memory and in OUT/tau_texts.json for a resumed run."""
        if self._tau_texts is None:
            e = self.recipe.eval
            n = min(e.tau_prompts, len(self.data))
            prompts = [self.data[i]["input_ids"][: e.tau_prompt_tokens].tolist() for i in range(n)]
            self._tau_texts = self.stored_texts(TAU_TEXTS, prompts)
        return self._tau_texts

    def prompt_texts(self) -> tuple[list[list[int]], list[list[int]]]:
        """The target's continuations of eval.prompts, as `tau_texts` (OUT/prompt_texts.json)."""
        if self._prompt_texts is None:
            self._prompt_texts = self.stored_texts(PROMPT_TEXTS, self.prompt_ids)
        return self._prompt_texts

    def stored_texts(self, name: str, prompts: list[list[int]]) -> tuple[list, list]:
        """(prompts, the target's continuations of them): eval.tau_tokens each at
        eval.temperature, read back from OUT/`name` when it holds these prompts and settings,
        else generated and written there. Every process computes the same texts (one seed);
        the main process writes the file."""
        e = self.recipe.eval
        settings = {
            "target": recipe_to_dict(self.recipe)["target"],
            "temperature": e.temperature,
            "tau_tokens": e.tau_tokens,
            "seed": self.recipe.train.seed,
        }
        settings = json.loads(json.dumps(settings))  # as it reads back from the file
        path = self.out / name
        stored = json.loads(path.read_text()) if path.is_file() else None
        if stored and stored.get("settings") == settings and stored.get("prompts") == prompts:
            return prompts, stored["outputs"]
        outputs = held_out_texts(
            self.core.target,
            prompts,
            temperature=e.temperature,
            max_new_tokens=e.tau_tokens,
            seed=self.recipe.train.seed,
        )
        if self.core.accelerator.is_main_process:
            record = {"settings": settings, "prompts": prompts, "outputs": outputs}
            atomic_write_text(path, json.dumps(record))
        return prompts, outputs

    def speculative(self) -> dict | None:
        """Real speculative decoding (eval/sweep.py) on held-out prompts, main process only:
        measured τ and speedup per γ next to the offline α, as a metrics.jsonl line (None on
        the other processes). A sharded draft is first gathered into a whole copy on the main
        process, with every process taking part, so that the main process decodes alone."""
        core, s = self.core, self.recipe.eval.speculative
        draft = core.full_draft()
        if not core.accelerator.is_main_process:
            return None
        n = min(s.prompts, len(self.data))
        prompts = [self.data[i]["input_ids"][: s.prompt_tokens].tolist() for i in range(n)]
        temperature = self.recipe.eval.temperature
        settings = Settings(
            gammas=list(s.gammas),
            temperatures=(temperature,),
            max_new_tokens=s.max_new_tokens,
            seed=self.recipe.train.seed,
        )
        # Without the greedy check: its high-precision copy of the target would need memory
        # that training holds, for a result the metrics line does not log.
        result, _ = sweep(core.target, draft, prompts, settings, check_greedy=False)
        configs = {c["gamma"]: c for c in result["configs"]}
        best = result["best_gamma"][f"{temperature:g}"]["measured"]
        record = {"step": core.step, "spec/best_gamma": best}
        for g in s.gammas:
            record[f"spec/tau_{g}"] = configs[g]["tau"]
            record[f"spec/speedup_{g}"] = configs[g]["speedup"]
        return record


def prompts_max_tokens(recipe, target=None) -> int:
    """eval.prompts_max_tokens as a run uses it: the recipe's value when it sets the key (the
    trainer refuses one beyond the target's context), else the default cut to the target's
    context (`max_position_embeddings`; unknown: the default)."""
    e = recipe.eval
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if "prompts_max_tokens" in e.model_fields_set or not isinstance(context, int) or context < 1:
        return e.prompts_max_tokens
    return min(e.prompts_max_tokens, context)


def outside_prompts(recipe, kind, tokenizer, target=None) -> list[list[int]]:
    """eval.prompts as token ids (eval/prompt_source.py; [] when unset), read when the run
    starts so that a bad source stops it before training, each cut to `prompts_max_tokens`.
    The chain τ_pred samples the draft's own chains: a draft type without them
    (`capabilities.accepted_length`) is refused."""
    e = recipe.eval
    if e.prompts is None:
        return []
    if not kind.capabilities.accepted_length:
        raise UserError(
            f"eval.prompts: tau_pred_chain scores the draft's own token-by-token chains, which "
            f"draft.type={recipe.draft.type} does not draft; unset eval.prompts"
        )
    return source_prompt_ids(
        e.prompts,
        tokenizer,
        limit=e.prompts_limit,
        max_tokens=prompts_max_tokens(recipe, target),
    )
