"""`specdistill regenerate` on bad inputs: malformed records are named and counted, arguments
out of range are refused before anything runs, failures are recorded once per prompt."""

import json

import pytest

from specdistill import cli
from specdistill.eval import engine
from specdistill.train.config import load_recipe
from specdistill.train.regenerate import RegenerateError, Sampling, regenerate
from specdistill.train.regenerate_output import FAILURES
from tests.train.helpers import overrides


def _row(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"write code {i}"}]})


def test_malformed_records_are_named_and_counted(tiny_pair, tmp_path):
    data = tmp_path / "chat.jsonl"
    lines = [_row(0), "{broken", "[1, 2]", json.dumps({"messages": "hi"}), _row(1)]
    data.write_text("\n".join(lines) + "\n")
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u", **{"data.train": str(data)}))
    printed = []
    manifest = regenerate(
        recipe,
        tmp_path / "regen",
        sampling=Sampling(max_new_tokens=2),
        print=lambda *a: printed.append(" ".join(map(str, a))),
    )
    assert manifest["prompts"] == 2 and manifest["complete"]
    assert manifest["skipped"] == {"invalid JSON": 1, "not a JSON object": 1, "malformed record": 1}
    assert "skipped 3 malformed records" in printed[0]
    for line in (2, 3, 4):
        assert any(f"{data}:{line}: " in p for p in printed), line


@pytest.mark.parametrize(
    "sampling, sizes, message",
    [
        (Sampling(temperature=-1), {}, "--temperature must be a finite number >= 0, got -1"),
        (Sampling(temperature=float("nan")), {}, "--temperature must be a finite number >= 0"),
        (Sampling(top_p=5), {}, r"--top-p must be in \(0, 1\], got 5"),
        (Sampling(top_p=0), {}, r"--top-p must be in \(0, 1\], got 0"),
        (Sampling(top_k=0), {}, "--top-k must be an integer >= 1, got 0"),
        (Sampling(max_new_tokens=0), {}, "--max-new-tokens must be an integer >= 1, got 0"),
        (Sampling(), {"batch_size": 0}, "--batch-size must be an integer >= 1, got 0"),
        (Sampling(), {"retries": -1}, "--retries must be an integer >= 0, got -1"),
        (Sampling(), {"shard_records": 0}, "--shard-records must be an integer >= 1, got 0"),
    ],
)
def test_arguments_out_of_range_are_refused_before_anything(
    tiny_pair, tmp_path, sampling, sizes, message
):
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u"))
    out = tmp_path / "regen"

    def never(*args, **kwargs):
        raise AssertionError("no prompt may be generated")

    with pytest.raises(RegenerateError, match=message):
        regenerate(recipe, out, sampling=sampling, generate=never, print=lambda *a: None, **sizes)
    assert not out.exists()


def test_cli_refuses_a_negative_temperature_with_exit_2(tiny_pair, tmp_path, capsys):
    out = tmp_path / "regen"
    argv = ["regenerate", "--out", str(out), "--temperature", "-1", "--max-new-tokens", "2"]
    assert cli.main(argv + overrides(tiny_pair, tmp_path / "u")) == 2
    assert "error: --temperature must be a finite number >= 0, got -1" in capsys.readouterr().err
    assert not out.exists()


def test_a_rerun_records_each_failing_prompt_once(tiny_pair, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(_row(i) + "\n" for i in range(3)))
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u", **{"data.train": str(data)}))
    out = tmp_path / "regen"

    def fails_alone(target, draft, prompts, **kwargs):
        if len(prompts) == 1 and prompts[0] == first[0]:
            raise RuntimeError("simulated failure")
        if len(prompts) > 1:
            raise RuntimeError("batch failed")
        return engine.generate(target, draft, prompts, **kwargs)

    from specdistill.eval.prompts import Prompt, encode_prompts
    from specdistill.models.hub import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_pair[0]))
    first = encode_prompts(
        [Prompt("0", messages=[{"role": "user", "content": "write code 0"}])], tokenizer
    )
    for run in (1, 2):
        manifest = regenerate(
            recipe,
            out,
            sampling=Sampling(max_new_tokens=2),
            retries=1,
            generate=fails_alone,
            print=lambda *a: None,
        )
        assert manifest["answered"] == 2 and manifest["failed_this_run"] == 1
        (failure,) = [json.loads(x) for x in (out / FAILURES).read_text().splitlines()]
        assert failure["runs"] == run and failure["attempts"] == 2 * run
    # answered at last: no longer listed
    manifest = regenerate(
        recipe, out, sampling=Sampling(max_new_tokens=2), retries=1, print=lambda *a: None
    )
    assert manifest["complete"] and (out / FAILURES).read_text() == ""
