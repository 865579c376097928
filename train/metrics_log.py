"""The offline run's metrics: metrics.jsonl in its output_dir, mirrored to Weights & Biases
when the recipe's `wandb.project` is set (numbers only). Only the main process writes."""

import json
from pathlib import Path

from specdistill.train.config import recipe_to_dict


class MetricsLog:
    def __init__(self, out: Path, accelerator):
        self.path = Path(out) / "metrics.jsonl"
        self.accelerator = accelerator
        self._wandb = None

    def start_wandb(self, recipe) -> None:
        w = recipe.wandb
        if w.project is None or w.mode == "disabled" or not self.accelerator.is_main_process:
            return
        import wandb  # lazy: wandb is slow to import; only a run that logs to wandb needs it

        self._wandb = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name,
            mode=w.mode,
            dir=str(self.path.parent),
            config=recipe_to_dict(recipe),
        )

    def log(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            numbers = {k: v for k, v in record.items() if isinstance(v, int | float)}
            self._wandb.log(numbers, step=record["step"])

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
