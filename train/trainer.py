"""The offline distillation run: a frozen target, a trainable draft, an acceptance-optimising
loss, from a recipe to final/, best/ and eval.json.

The parts (each its own module): the step core (train/step.py `DistillStep`: models,
optimiser, schedule, the loss of one global batch), the target source (train/targets.py:
the live target or the top-N cache), the data order (train/batches.py: a function of
(seed, step) alone, so that a resumed run replays exactly what an uninterrupted one would
have seen), the evaluations (train/evaluation.py), the run directory (train/run_dir.py:
first writes, leftovers, checkpoints, the metrics log cut back on resume), the metrics log
(train/metrics_log.py) and the published outputs (train/outputs.py). `Trainer` runs the loop
and prints the console lines.

The run is safe to kill and to rerun: the output_dir and the resume are validated before any
model loads (`prepare_output_dir`), checkpoints, final/ and eval.json are published
atomically, a damaged checkpoint falls back to the previous one, and metrics.jsonl is cut
back to the resumed checkpoint. What is guaranteed, and the test of each guarantee:
docs/reliability.md.
"""

import sys
import time
from pathlib import Path

import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from specdistill import drafts
from specdistill.bounds import BoundsError, context_limit
from specdistill.models import hub
from specdistill.models.target_spec import (
    TargetSpec,
    load_target_and_tokenizer,
    with_pad_token,
)
from specdistill.publish import atomic_write_text
from specdistill.threads import ThreadPolicy
from specdistill.train.batches import Batches, accumulation_steps
from specdistill.train.config import (
    Recipe,
    RecipeError,
    recipe_datasets,
    recipe_to_dict,
)
from specdistill.train.distributed import check_layout, layout, make_accelerator
from specdistill.train.evaluation import Evaluator, eval_record
from specdistill.train.metrics_log import MetricsLog
from specdistill.train.on_policy import for_core
from specdistill.train.outputs import Outputs
from specdistill.train.run_dir import RunDir
from specdistill.train.run_plan import (
    RunPlan,
    prepare_output_dir,
    progress_line,
    quiet_library_bars,
    restore_int_keys,
)
from specdistill.train.step import DistillStep, lr_lambda, trainable_parameters
from specdistill.train.target_cache import CacheError, open_cache
from specdistill.train.targets import IndexedTargets

__all__ = ["Trainer", "lr_lambda", "trainable_parameters"]


def best_record(metrics: dict) -> dict:
    keys = ("step", "alpha", "alpha_greedy", "tau_pred")
    return {k: metrics[k] for k in keys if k in metrics}


def before_line(recipe, alpha: float, greedy: float) -> str:
    return f"alpha before: {alpha:.4f} (T={recipe.eval.temperature}), greedy {greedy:.4f}"


def after_line(recipe, out: Path, final: dict, tau_before: dict) -> str:
    """The console's summary of a finished run: α and τ_pred after training, the best
    held-out evaluation when it was not the final one, the acceptance head's calibration."""
    nan = float("nan")
    lines = [
        f"alpha after:  {final['alpha']:.4f} (T={recipe.eval.temperature}), greedy "
        f"{final['alpha_greedy']:.4f} | tau_pred(gamma=5) {tau_before.get(5, nan):.3f} -> "
        f"{final['tau_pred'].get(5, nan):.3f}{chain_part(final)} | outputs in {out}"
    ]
    if (best := final.get("best")) and best["step"] != final.get("steps"):
        lines.append(f"best held-out alpha {best['alpha']:.4f} at step {best['step']}: {out}/best")
    if head := final.get("acceptance_head"):
        lines.append(head_line(head))
    return "\n".join(lines)


def chain_part(final: dict) -> str:
    """The chain τ_pred on eval.prompts (eval.json's tau_pred_chain), when the run has one."""
    chain = final.get("tau_pred_chain")
    if not chain or 5 not in chain:
        return ""
    return f" | tau_pred_chain(gamma=5) {chain[5]:.3f} on eval.prompts"


def head_line(report: dict) -> str:
    """The acceptance head's calibration on the console (eval.json's `acceptance_head`)."""
    ece = "n/a" if report["ece"] is None else f"{report['ece']:.3f}"
    return f"acceptance head: ECE {ece} on {report['n']} held-out positions"


def report_finished(recipe, out: Path, finished: dict, say=print) -> dict:
    """A rerun of a complete run (train.resume=auto, e.g. the README command run twice):
    print the stored result (eval.json) and change nothing."""
    result = restore_int_keys(finished)
    say(
        f"{out} already holds the finished run of this recipe ({result['steps']} "
        "steps): nothing to train. Pass train.max_steps=<more> to continue it, or "
        "train.overwrite=true to train it again."
    )
    say(before_line(recipe, result["alpha_before"], result["alpha_greedy_before"]))
    say(after_line(recipe, out, result, result["tau_pred_before"]))
    return result


def check_context(r: Recipe, target) -> None:
    """RecipeError when `data.max_length`, or `eval.prompts_max_tokens` set with
    `eval.prompts`, is beyond the target's context (its `max_position_embeddings`): positions
    it never saw. A default `eval.prompts_max_tokens` is cut to the context instead
    (train/evaluation.py `prompts_max_tokens`)."""
    context = getattr(target.config, "max_position_embeddings", None)
    given = r.eval.prompts and "prompts_max_tokens" in r.eval.model_fields_set
    prompts = r.eval.prompts_max_tokens if given else None
    try:
        context_limit("data.max_length", r.data.max_length, context, r.target.model)
        context_limit("eval.prompts_max_tokens", prompts, context, r.target.model)
    except BoundsError as e:
        raise RecipeError(str(e)) from None


class Trainer:
    """Trains `draft` against the frozen `target` as `recipe` says, writing into its output_dir.

    Built from parts (tests and benchmarks hand in their own models, data or accelerator);
    `Trainer.from_recipe(recipe)` does the usual wiring: validate the output_dir, start
    accelerate, load the target, the data and the draft.
    """

    def __init__(
        self,
        recipe: Recipe,
        *,
        accelerator: Accelerator,
        plan: RunPlan,
        target=None,
        draft=None,
        kind=None,
        tokenizer=None,
        train_data=None,
        eval_data=None,
        cache=None,
    ):
        """target, draft (a module, not yet prepared), kind (its draft type, drafts/),
        tokenizer and the datasets may be None only when `plan` is a finished run. cache: a
        train.target_cache.TargetCache (target.cache), or None: the live target."""
        self.recipe = r = recipe
        self.plan, self.out = plan, plan.out
        self.accelerator = acc = accelerator
        self.run_dir = RunDir(self.out, acc)
        self.metrics = MetricsLog(self.out, acc)
        self.alpha_before: dict | None = None
        self.history: list[dict] = []
        # The held-out-α-best evaluation so far ({"step", "alpha", ...}); its draft is best/.
        self.best: dict | None = None
        self.core: DistillStep | None = None
        self._cache = None
        if plan.finished is not None:
            return  # nothing to train: run() reports the stored result
        self.accum = accumulation_steps(r, acc)
        check_layout(acc, self.accum, r.train.max_grad_norm, r.loss.chunk_size)
        self.tokenizer, self.kind = with_pad_token(tokenizer), kind
        self.train_data, self.eval_data = train_data, eval_data
        self.core = DistillStep(r, accelerator=acc, target=target, draft=draft, kind=kind)
        held = Batches(eval_data, recipe=r, accelerator=acc, pad_token_id=tokenizer.pad_token_id)
        self.evaluator = Evaluator(r, self.core, held, self.out, tokenizer)
        self.outputs = Outputs(r, self.out, kind, tokenizer)
        self.on_policy = None  # a train.on_policy.OnPolicy with data.on_policy.fraction > 0
        if r.data.on_policy.fraction > 0:
            self.on_policy = for_core(r, self.core, tokenizer)
        self.cache = cache

    @classmethod
    def from_recipe(cls, recipe: Recipe, accelerator: Accelerator | None = None) -> "Trainer":
        """The whole wiring of a run from its recipe. The output_dir is validated before any
        model loads, so that a run that cannot go on fails in seconds and writes nothing."""
        r = recipe
        plan = prepare_output_dir(recipe)
        # Without a GPU: a gloo group, DDP or (an FSDP launch) FSDP2 (train/distributed.py).
        acc = accelerator or make_accelerator(r.train.mixed_precision)
        set_seed(r.train.seed)
        if plan.finished is not None:
            return cls(recipe, accelerator=acc, plan=plan)
        # Only the main process builds an embedded model; the others wait, then load it.
        with acc.main_process_first(), quiet_library_bars():
            target, tokenizer = load_target_and_tokenizer(TargetSpec.from_recipe(r.target))
            check_context(r, target)  # before the data is cut to a length it cannot see
            train_data, eval_data = recipe_datasets(r, tokenizer)
            try:
                draft, kind = drafts.build(r.draft, target, tokenizer, train_data, print=acc.print)
            except hub.TokenizerMismatchError:
                raise
            except ValueError as e:  # a draft that does not fit this target or recipe
                raise RecipeError(str(e)) from None
            cache = None
            if r.target.cache is not None:  # checked against this run before any training
                try:
                    cache = open_cache(
                        r,
                        tokenizer=tokenizer,
                        target=target,
                        train_data=train_data,
                        vocab_size=kind.vocab_size,
                        kind=kind,
                    )
                except CacheError as e:
                    raise RecipeError(str(e)) from None
        return cls(
            recipe,
            accelerator=acc,
            plan=plan,
            target=target,
            draft=draft,
            kind=kind,
            tokenizer=tokenizer,
            train_data=train_data,
            eval_data=eval_data,
            cache=cache,
        )

    # ----------------------------------------------------------------------------- parts
    step = property(lambda self: 0 if self.core is None else self.core.step)
    draft = property(lambda self: self.core.draft)
    target = property(lambda self: self.core.target)
    vocab_size = property(lambda self: self.core.vocab_size)

    @property
    def cache(self):
        """The target's cached top-N (train/target_cache.py) trained on; None: the live one."""
        return self._cache

    @cache.setter
    def cache(self, cache) -> None:
        """Train on `cache`: the core's target source and the data order follow."""
        self._cache = cache
        self.core.set_targets(None if cache is None else IndexedTargets(cache, self.vocab_size))
        self.batches = Batches(
            self.train_data,
            recipe=self.recipe,
            accelerator=self.accelerator,
            pad_token_id=self.tokenizer.pad_token_id,
            indexed=cache is not None,
        )
        self.batches.use_on_policy(self.on_policy)

    def micro_batches(self, step: int) -> list[dict]:
        return self.batches.micro_batches(step)

    def eval_batches(self) -> list[dict]:
        return self.evaluator.batches()

    def train_step(self, step: int) -> dict:
        """Optimiser step `step` on its global batch; its metrics.jsonl record."""
        record = self.core.train_step(self.batches.micro_batches(step)).record()
        if self.on_policy is not None:  # the generation's cost, apart from training's
            record.update(self.on_policy.take_metrics(self.accelerator))
        return record

    def loss(self, batch: dict):
        return self.core.loss(batch)

    def evaluate(self) -> dict:
        return self.evaluator.evaluate()

    def speculative_eval(self) -> dict | None:
        record = self.evaluator.speculative()
        if record is not None:
            self.metrics.log(record)
        self.accelerator.wait_for_everyone()
        return record

    # ----------------------------------------------------------------------------- state
    def save_checkpoint(self) -> None:
        """A checkpoint of the core and the run's state (train/run_dir.py), with the size of
        metrics.jsonl: a resume cuts the log back to it."""
        state = {
            "alpha_before": self.alpha_before,
            "history": self.history,
            "best": self.best,
            "metrics_bytes": self.run_dir.log_sizes(["metrics.jsonl"])["metrics.jsonl"],
        }
        self.run_dir.save_checkpoint(self.core, state, self.recipe)

    def resume(self) -> tuple[Path, dict] | None:
        """Load the newest checkpoint of the plan that loads (train/run_dir.py `resume`):
        (its path, its trainer state), or None for a fresh start."""
        resumed = self.run_dir.resume(
            self.core, self.plan.resume_from, self.recipe, say=self.accelerator.print
        )
        if resumed is not None:
            state = resumed[1]
            self.alpha_before = restore_int_keys(state["alpha_before"])
            self.history = state["history"]
            self.best = restore_int_keys(state["best"]) if state.get("best") else None
        return resumed

    # ----------------------------------------------------------------------------- run
    def run(self) -> dict:
        acc, r = self.accelerator, self.recipe
        if self.plan.finished is not None:
            return report_finished(r, self.out, self.plan.finished, say=acc.print)
        self.run_dir.start(clear=self.plan.clear, say=acc.print)
        self.threads = started_threads(r, acc)
        resumed = self.resume()
        if acc.is_main_process:
            self.run_dir.trim_metrics(resumed, say=acc.print)
            atomic_write_text(self.out / "recipe.yaml", yaml_text(r))
        acc.wait_for_everyone()
        self.metrics.start_wandb(r)
        acc.print(
            f"target {r.target.model} | draft {r.draft.model} | loss {r.loss.name} | "
            f"{len(self.train_data)} train / {len(self.eval_data)} eval sequences | "
            f"{acc.num_processes} process(es) ({layout(acc)}) × {self.accum} accumulation step(s)"
        )
        skipped = {"train": self.train_data.stats.skipped, "eval": self.eval_data.stats.skipped}
        if any(skipped.values()) and resumed is None:  # a resumed log has it already
            self.metrics.log(skipped_record(self.step, skipped))
        if self.alpha_before is None:
            self.alpha_before = self.evaluate()
            self.metrics.log(eval_record(self.step, self.alpha_before))
        before = self.alpha_before
        acc.print(before_line(r, before["alpha"], before["alpha_greedy"]))
        self._loop()
        final = self.evaluate()
        self.history.append({"step": self.step, "alpha": final["alpha"]})
        self.metrics.log(eval_record(self.step, final))
        spec = self.speculative_eval() if r.eval.speculative.every else None
        if spec is not None:
            final["speculative"] = spec
        result = {
            **final,
            "alpha_before": before["alpha"],
            "alpha_greedy_before": before["alpha_greedy"],
            "tau_pred_before": before["tau_pred"],
            "steps": self.step,
            "loss": r.loss.name,
            "draft_type": r.draft.type,
            "trainable_params": trainable_parameters(self.draft),
            "history": self.history,
            "data_skipped": skipped,
            **self.evaluator.head_entry(),  # the trained acceptance head's calibration
        }
        final_is_best = self.best is None or final["alpha"] > self.best["alpha"]
        if final_is_best:
            self.best = best_record({**final, "step": self.step})
        result["best"] = self.best
        self.save_final(result, copy_to_best=final_is_best)
        acc.print(after_line(r, self.out, result, before["tau_pred"]))
        self.metrics.finish()
        self.core.release_wrapper()  # before end_training destroys the process group
        acc.end_training()
        return result

    def _loop(self) -> None:
        """Optimiser steps up to train.max_steps, with the periodic logs, evaluations and
        checkpoints. A progress bar only on a terminal; in a log file, plain lines every
        train.log_every."""
        acc, r = self.accelerator, self.recipe
        use_bar = acc.is_local_main_process and sys.stderr.isatty()
        bar = tqdm(
            total=r.train.max_steps,
            initial=self.step,
            disable=not use_bar,
            desc="distill",
            dynamic_ncols=True,
        )
        say = bar.write if use_bar else acc.print
        start = time.perf_counter()
        while self.step < r.train.max_steps:
            record = self.train_step(self.step)
            self.threads.recheck(say=say)  # acc.print says nothing off the main process
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", alpha=f"{record['alpha']:.3f}")
            if self.step % r.train.log_every == 0 or self.step == r.train.max_steps:
                record["elapsed_s"] = time.perf_counter() - start
                self.metrics.log(record)
                if not use_bar:
                    acc.print(progress_line(record, r.train.max_steps))
            if r.eval.every and self.step % r.eval.every == 0 and self.step < r.train.max_steps:
                metrics = self.evaluate()
                self.history.append({"step": self.step, "alpha": metrics["alpha"]})
                self.metrics.log(eval_record(self.step, metrics))
                say(f"step {self.step}: held-out alpha {metrics['alpha']:.4f}")
                self.keep_best(metrics)
            spec_every = r.eval.speculative.every
            if spec_every and self.step % spec_every == 0 and self.step < r.train.max_steps:
                self.speculative_eval()
            if r.train.save_every and self.step % r.train.save_every == 0:
                self.save_checkpoint()
        bar.close()

    def keep_best(self, metrics: dict) -> None:
        """After a periodic held-out evaluation: when its α beats every earlier one, publish
        the draft as best/ (checkpoints are chosen by α, not by loss). Every process calls it:
        a sharded draft is gathered."""
        if self.best is not None and metrics["alpha"] <= self.best["alpha"]:
            return
        self.best = best_record({**metrics, "step": self.step})
        draft = self.core.full_draft()
        if self.accelerator.is_main_process:
            self.outputs.publish_best(draft)
        self.accelerator.wait_for_everyone()

    def save_final(self, result: dict, *, copy_to_best: bool = False) -> None:
        """final/ (and best/ too when the final evaluation is the best), then eval.json."""
        acc = self.accelerator
        acc.wait_for_everyone()
        draft = self.core.full_draft()  # every process: a sharded draft is gathered
        if acc.is_main_process:
            self.outputs.save_final(draft, result, copy_to_best=copy_to_best)


def skipped_record(step: int, skipped: dict) -> dict:
    """The metrics line of the malformed records skipped in the training and held-out data."""
    return {"step": step, "data/skipped": skipped["train"], "data/skipped_eval": skipped["eval"]}


def started_threads(recipe, acc: Accelerator) -> ThreadPolicy:
    """This process's torch threads (specdistill/threads.py): train.threads, else its share
    of the cores free now; said by the main process."""
    policy = ThreadPolicy(
        recipe.train.threads, name="train.threads", share=acc.num_processes, say=acc.print
    )
    policy.start()
    return policy


def yaml_text(recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)
