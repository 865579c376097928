"""Records skipped with data.skip_malformed are counted in metrics.jsonl and eval.json."""

import json

from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer
from tests.helpers import TEXT
from tests.train.helpers import metrics, overrides


def write_jsonl(path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_skipped_records_are_counted_in_outputs(tiny_pair, tmp_path):
    docs = [{"text": text} for text in TEXT * 4]
    train = write_jsonl(tmp_path / "train.jsonl", ["{not json", *docs, "[1, 2]", "{"])
    eval = write_jsonl(tmp_path / "eval.jsonl", [*docs[:4], {"txt": "x"}])
    out = tmp_path / "run"
    extra = {
        "data.train": train,
        "data.eval": eval,
        "data.skip_malformed": "true",
        "train.max_steps": 2,
    }
    result = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    expected = {
        "train": {"invalid JSON": 2, "not a JSON object": 1},
        "eval": {"no text or messages": 1},
    }
    assert result["data_skipped"] == expected
    assert json.loads((out / "eval.json").read_text())["data_skipped"] == expected
    (record,) = [m for m in metrics(out) if "data/skipped" in m]
    assert record == {
        "step": 0,
        "data/skipped": expected["train"],
        "data/skipped_eval": expected["eval"],
    }


def test_nothing_skipped_is_an_empty_count(tiny_pair, tmp_path):
    out = tmp_path / "run"
    extra = {"data.skip_malformed": "true", "train.max_steps": 2}
    result = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    assert result["data_skipped"] == {"train": {}, "eval": {}}
    assert not [m for m in metrics(out) if "data/skipped" in m]
