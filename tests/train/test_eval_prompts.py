"""eval.prompts: prompts from outside the training data, on which every evaluation also reports
tau_pred_chain (the draft's own chains scored by the target, eval/chain_tau.py) and eval.json
says which text each τ_pred comes from."""

import json

import pytest

from specdistill.drafts import Parallel
from specdistill.errors import UserError
from specdistill.eval.prompt_source import source_prompt_ids
from specdistill.formats.traffic_shards import shard_name
from specdistill.train.config import load_recipe
from specdistill.train.evaluation import PROMPT_TEXTS, outside_prompts
from specdistill.train.trainer import Trainer
from tests.serve.helpers import record
from tests.train.helpers import metrics, overrides

PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n", "import os\n", "x = 1\n"]


def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def test_a_run_with_eval_prompts_reports_the_chain_tau(tiny_pair, tmp_path, capsys):
    prompts, out = prompt_file(tmp_path), tmp_path / "run"
    extra = {
        "eval.prompts": str(prompts),
        "eval.prompts_limit": 3,
        "eval.tau_tokens": 16,
        "train.max_steps": 4,
    }
    Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    report = json.loads((out / "eval.json").read_text())
    chain = {int(g): t for g, t in report["tau_pred_chain"].items()}
    assert set(chain) == set(range(1, 9))
    assert all(1.0 <= t <= g + 1 for g, t in chain.items())
    assert chain != {int(g): t for g, t in report["tau_pred"].items()}  # its own figure
    domains = report["tau_domains"]
    assert set(domains) == {"tau_pred_iid", "tau_pred", "tau_pred_chain"}
    assert str(prompts) in domains["tau_pred_chain"] and "3 prompts" in domains["tau_pred_chain"]
    assert "held-out" in domains["tau_pred_iid"] and "held-out" in domains["tau_pred"]
    texts = json.loads((out / PROMPT_TEXTS).read_text())
    assert len(texts["prompts"]) == len(texts["outputs"]) == 3
    assert all(len(o) == 16 for o in texts["outputs"])
    logged = metrics(out)
    assert any("eval/tau_pred_chain_5" in m for m in logged)
    assert not any("eval/tau_domains" in m for m in logged)
    assert f"tau_pred_chain(gamma=5) {chain[5]:.3f} on eval.prompts" in capsys.readouterr().out


def test_a_run_without_eval_prompts_has_no_chain_figure(tiny_pair, tmp_path):
    out = tmp_path / "run"
    extra = {"train.max_steps": 2, "eval.tau_tokens": 16}
    Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    report = json.loads((out / "eval.json").read_text())
    assert "tau_pred_chain" not in report and "tau_domains" not in report
    assert not (out / PROMPT_TEXTS).exists()


def test_a_traffic_directory_gives_its_records_prompt_ids(tmp_path):
    lines = [record(id=f"r{i}", prompt_token_ids=list(range(1, 3 + i))) for i in range(4)]
    (tmp_path / shard_name(1)).write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert source_prompt_ids(str(tmp_path), None, limit=3, max_tokens=3) == [
        [1, 2],
        [1, 2, 3],
        [2, 3, 4],
    ]


def test_a_missing_source_and_a_type_without_chains_are_refused(tiny_pair, tmp_path):
    with pytest.raises(UserError, match="eval.prompts .*no such file or directory"):
        source_prompt_ids(str(tmp_path / "nowhere.jsonl"), None, limit=2, max_tokens=8)
    extra = {"eval.prompts": str(prompt_file(tmp_path)), "draft.type": "parallel"}
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "run", **extra))
    with pytest.raises(UserError, match="draft.type=parallel does not draft; unset eval.prompts"):
        outside_prompts(recipe, Parallel, None)


@pytest.mark.parametrize("content", [b"\0" * 4096, b"def f():\n" + b"\0\x01\x02" * 100 + b"\n"])
def test_a_binary_prompt_file_is_refused_in_one_line(tiny_pair, tmp_path, capsys, content):
    from specdistill import cli
    from specdistill.eval.prompts import PromptError, load_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    line = content[: content.index(b"\0")].count(b"\n") + 1
    with pytest.raises(PromptError, match=f"^{path}:{line}: a NUL byte: a binary file"):
        load_prompts(path)
    out = tmp_path / "run"
    assert cli.main(["distill", *overrides(tiny_pair, out, **{"eval.prompts": str(path)})]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{path}:{line}: a NUL byte" in lines[0]
    assert not out.exists() or not any(out.iterdir())
