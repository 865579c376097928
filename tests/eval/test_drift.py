"""α drift (eval/drift.py) and peft targets (models/hub.py load_target) on the tiny pair."""

import json

import numpy as np
import pytest
import torch

from specdistill.eval import drift, drift_cli
from specdistill.eval.prompts import load_prompts
from specdistill.models import hub
from tests.helpers import make_lora_adapter


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("drift_prompts") / "prompts.jsonl"
    starts = ["def add(a, b):\n", "class Point:\n", "for i in range(", "import os\n"]
    with open(path, "w") as f:
        for i in range(12):
            category = "code" if i % 3 else "loops"
            f.write(json.dumps({"id": i, "category": category, "prompt": starts[i % 4]}) + "\n")
    return path


def test_self_drift_is_exactly_zero(tiny_pair, prompt_file, tmp_path):  # noqa: F811
    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    run = drift_cli.run(
        [
            "--draft", str(draft),
            "--target-before", str(target),
            "--target-after", str(target),
            "--prompts", str(prompt_file),
            "--out", str(out),
            "--max-new-tokens", "8",
            "--min-samples", "5",
            "--bootstrap", "200",
            "--device", "cpu",
        ]
    )  # fmt: skip
    assert list(run.reports) == [1.0]  # the default serving temperature
    report = run.reports[1.0]
    assert report["alpha_before"] == report["alpha_after"]
    assert report["alpha_greedy_before"] == report["alpha_greedy_after"]
    assert report["target_tv"] == 0.0 and report["target_argmax_disagreement"] == 0.0
    assert report["alpha_drop_ci"] == [0.0, 0.0]
    assert not report["verdict"]["refit_recommended"]
    saved = json.loads((out / "report.json").read_text())
    for key in ("alpha_before", "alpha_after", "alpha_greedy_before", "alpha_greedy_after",
                "target_tv", "per_category", "verdict"):  # fmt: skip
        assert key in saved
    assert set(saved["per_category"]) == {"code", "loops"}
    assert saved["per_category"]["loops"]["insufficient"] is True  # 4 prompts < 5
    assert saved["per_category"]["code"]["drop"] == 0.0
    typed = drift.DriftReport.read(out / "report.json")  # report.json's schema reads it back
    typed.write_json(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (out / "report.json").read_text()
    assert typed.meta is not None and typed.meta.target_after == str(target)
    assert (out / "report.md").read_text().startswith("# α drift report")
    assert (out / "drift.png").stat().st_size > 0
    records = [
        json.loads(line) for line in (out / "responses_after.jsonl").read_text().splitlines()
    ]
    assert len(records) == 12 and all("text" in r for r in records)


def test_lora_scale_gives_monotone_drift(tiny_pair, prompt_file, tmp_path):  # noqa: F811
    target_dir, _, _ = tiny_pair
    tokenizer = hub.load_tokenizer(str(target_dir))
    before = hub.load_model(str(target_dir))
    draft = hub.load_model(str(target_dir))  # the draft is the before-target: α_before = 1
    prompts = load_prompts(prompt_file)
    tvs, drops = [], []
    for scale in (0.0, 0.5, 1.0, 2.0):
        adapter = make_lora_adapter(target_dir, tmp_path / f"adapter-{scale}", scale=scale)
        after = hub.load_target(str(target_dir), str(adapter))
        assert type(after).__name__ == "PeftModel"  # wrapped, not merged
        report, _ = drift.measure(
            before, after, draft, tokenizer, prompts,
            temperature=1.0, max_new_tokens=8, min_samples=4, bootstrap=100,
        )  # fmt: skip
        tvs.append(report["target_tv"])
        drops.append(report["alpha_drop"])
    assert tvs[0] == 0.0 and abs(drops[0]) < 1e-6
    assert all(a < b for a, b in zip(tvs, tvs[1:], strict=False)), tvs
    assert all(a < b for a, b in zip(drops, drops[1:], strict=False)), drops
    assert drops[-1] > 0.01


def test_unmerged_adapter_changes_only_lora_modules(tiny_pair, tmp_path):  # noqa: F811
    target_dir, _, _ = tiny_pair
    adapter = make_lora_adapter(target_dir, tmp_path / "adapter", scale=1.0)
    wrapped = hub.load_target(str(target_dir), str(adapter))
    base = hub.load_model(str(target_dir))
    inner = dict(wrapped.get_base_model().named_parameters())
    # The base weights are untouched (no merge): each layer's base_layer equals the base.
    name = "model.layers.0.self_attn.q_proj"
    assert torch.equal(
        inner[f"{name}.base_layer.weight"], dict(base.named_parameters())[f"{name}.weight"]
    )
    ids = torch.tensor([[5, 6, 7, 8]])
    assert not torch.allclose(wrapped(input_ids=ids).logits, base(input_ids=ids).logits)


def test_adapter_for_another_base_is_refused(tiny_pair, tmp_path):  # noqa: F811
    target_dir, draft_dir, _ = tiny_pair
    adapter = make_lora_adapter(draft_dir, tmp_path / "draft-adapter", scale=1.0)
    with pytest.raises(hub.AdapterMismatchError) as err:
        hub.load_target(str(target_dir), str(adapter))
    message = str(err.value)
    assert "does not belong to the base model" in message
    assert "hidden_size 16 vs 32" in message and str(draft_dir) in message
    with pytest.raises(hub.ModelNotFoundError, match="adapter_config.json missing"):
        hub.load_target(str(target_dir), str(tmp_path))


def test_bootstrap_and_categories_on_synthetic_data():
    rng = np.random.default_rng(0)
    n = 200
    counts = rng.integers(10, 50, size=n).astype(float)
    alpha_b = np.clip(rng.normal(0.8, 0.05, n), 0, 1)
    alpha_a = np.clip(alpha_b - 0.1 + rng.normal(0, 0.02, n), 0, 1)
    before = np.stack([alpha_b * counts, counts], 1)
    after = np.stack([alpha_a * counts, counts], 1)
    cell = drift.paired_bootstrap(before, after, samples=500)
    true_drop = (before[:, 0].sum() - after[:, 0].sum()) / counts.sum()
    assert cell["drop"] == pytest.approx(true_drop)
    lo, hi = cell["drop_ci"]
    assert lo < true_drop < hi and 0.08 < lo and hi < 0.12
    # Pairing: the drop's interval is much narrower than the α intervals themselves.
    assert hi - lo < 0.5 * (cell["before_ci"][1] - cell["before_ci"][0])
    same = drift.paired_bootstrap(before, before, samples=100)
    assert same["drop"] == 0.0 and same["drop_ci"] == [0.0, 0.0]

    categories = ["a"] * 150 + ["b"] * 45 + [None] * 5
    after_b = after.copy()
    after_b[150:195] = before[150:195]  # category b does not drift
    cells = drift.per_category(categories, before, after_b, min_samples=10, samples=300)
    assert set(cells) == {"a", "b", "uncategorised"}
    assert cells["uncategorised"] == {"n": 5, "insufficient": True, "min_samples": 10}
    assert cells["a"]["n"] == 150 and cells["a"]["drop_ci"][0] > 0.05
    assert cells["b"]["drop"] == 0.0 and cells["b"]["drop_ci"] == [0.0, 0.0]


def test_verdict_follows_the_interval():
    def score(b, a, n=20, category=None):
        s = drift.PromptScore(
            category,
            np.array([[b * n, b * n, n]]),
            np.array([[a * n, a * n, n]]),
            np.array([[b * n, b * n, n]]),
            np.array([0.0, 0.0, n]),
        )
        return s

    rng = np.random.default_rng(1)
    scores = [score(0.8 + rng.normal(0, 0.01), 0.7 + rng.normal(0, 0.01)) for _ in range(30)]
    assert drift.summarise(scores, threshold=0.05, samples=200)["verdict"]["refit_recommended"]
    assert not drift.summarise(scores, threshold=0.2, samples=200)["verdict"]["refit_recommended"]
    report = drift.summarise(scores, samples=50, max_gamma=4)
    assert report["tau_before"][1] == pytest.approx(1 + report["alpha_before"])
