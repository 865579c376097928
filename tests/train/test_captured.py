"""The target's outputs captured while it answers (train/captured.py): the target cache built
from them equals one built by a target pass over the answers, with no forward for the
sequences they serve; a sequence whose tokens are not what the target generated takes the
forward; a capture lost to a kill costs only a forward."""

import json

import pytest
import torch

from specdistill.train.captured import CAPTURED, CapturedOutputs
from specdistill.train.config import load_recipe
from specdistill.train.regenerate import Sampling, regenerate
from specdistill.train.target_cache import TargetCache
from specdistill.train.target_cache_build import build_cache
from tests.train.helpers import overrides

WORDS = ["user", "assistant", "write", "code", *"0123456789", *"abcdefghijklmnopqrstuvwxyz"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
V = len(WORDS) + len(SPECIAL) + 1  # a top-V capture holds every token
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def word_target(tmp_path_factory):
    """A tiny target over whole words: any sequence of its words decodes to text that
    tokenizes back to the same ids, as most of a real model's answers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import make_model

    vocab = {w: i for i, w in enumerate(["<unk>", *SPECIAL, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL[1:],
        chat_template=TEMPLATE,
    )
    root = tmp_path_factory.mktemp("word_target")
    model = make_model(tokenizer, hidden=32, layers=2, seed=3)
    with torch.no_grad():  # words, mostly: the special tokens rarely drawn mid-answer
        model.lm_head.weight.mul_(8.0)
        model.lm_head.weight[: len(SPECIAL) + 1] = 0.0
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def _prompts(tmp_path, n=16):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    words = "abcdefghijklmnopqrstuvwxyz"
    rows = [{"messages": [{"role": "user", "content": f"write code {words[i]}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tiny_pair, word_target, tmp_path, data):
    extra = {
        "target.model": str(word_target),
        "draft.model": "target-layers:1",
        "data.train": data,
        "data.max_length": 64,
        "data.pack": "false",  # one answer a sequence, as the prepared recipes train
    }
    return load_recipe(None, overrides(tiny_pair, tmp_path / "run", **extra))


def _answered(tiny_pair, word_target, tmp_path, top_n=V, dtype="float32"):
    """(the recipe training on the answers, the answers' directory), answered with capture."""
    out = tmp_path / "answers"
    regenerate(
        _recipe(tiny_pair, word_target, tmp_path, str(_prompts(tmp_path))),
        out,
        sampling=Sampling(temperature=1.0, max_new_tokens=12),
        batch_size=3,
        capture_top_n=top_n,
        capture_dtype=dtype,
        print=lambda *a: None,
    )
    return _recipe(tiny_pair, word_target, tmp_path, f"{out}/regen-*.jsonl"), out


def _forwards(monkeypatch):
    """A list that receives the row count of every forward of the tiny target's class."""
    from transformers import LlamaForCausalLM

    rows, forward = [], LlamaForCausalLM.forward

    def counted(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows.append(0 if ids is None else ids.shape[0])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", counted)
    return rows


def _rows(cache_dir):
    cache = TargetCache(cache_dir)
    n = cache.manifest["splits"]["train"]["sequences"]
    return [cache.rows("train", s) for s in range(n)]


def _dense(rows) -> list[torch.Tensor]:
    """Each sequence's stored probabilities as [n, V] (order-free) beside its rest mass."""
    return [
        torch.cat([torch.zeros(len(i), V).scatter(-1, i, v.exp()), r[:, None]], -1)
        for i, v, r in rows
    ]


def _assert_same_rows(a, b) -> None:
    for x, y in zip(_dense(_rows(a)), _dense(_rows(b)), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_a_cache_from_the_captured_outputs_equals_a_target_pass(
    tiny_pair, word_target, tmp_path, monkeypatch
):
    training, out = _answered(tiny_pair, word_target, tmp_path)
    build = dict(top_n=V, values_dtype="float32", splits=("train",), print=lambda *a: None)
    live = build_cache(training, tmp_path / "live", **build)
    forwards = _forwards(monkeypatch)
    captured = CapturedOutputs([out], V, V)
    assert len(captured) == 16  # one answer a prompt
    made = build_cache(training, tmp_path / "captured", captured=captured, **build)
    served = made["splits"]["train"]["captured"]
    sequences = made["splits"]["train"]["sequences"]
    assert served == {"served": sequences, "computed": 0, "why": {}} and sequences >= 5
    assert sum(forwards) == 0  # trained on the ids drawn, every answer is served
    assert made["splits"]["train"]["data_hash"] == live["splits"]["train"]["data_hash"]
    _assert_same_rows(tmp_path / "live", tmp_path / "captured")


def test_tokens_other_than_the_generated_ones_take_the_forward(tiny_pair, word_target, tmp_path):
    training, out = _answered(tiny_pair, word_target, tmp_path, top_n=8, dtype="float16")
    captured = CapturedOutputs([out], 8, V)
    from specdistill.data import collate
    from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer
    from specdistill.train.config import recipe_datasets
    from specdistill.train.target_cache import valid_rows

    _, tokenizer = load_target_and_tokenizer(TargetSpec.from_recipe(training.target))
    data, _ = recipe_datasets(training, tokenizer)
    item = next(
        data[i]
        for i in range(len(data))
        if captured.rows(
            data[i]["input_ids"], valid_rows(collate([data[i]], tokenizer.pad_token_id))[0]
        )
        is not None
    )
    valid = valid_rows(collate([item], tokenizer.pad_token_id))[0]
    trained = (valid.nonzero().squeeze(-1) + 1).tolist()
    assert len(trained) >= 2
    ids = item["input_ids"].clone()
    ids[trained[0]] = (ids[trained[0]] + 1) % V  # a token that conditions later positions
    assert captured.rows(ids, valid) is None
    ids = item["input_ids"].clone()
    ids[trained[-1]] = (ids[trained[-1]] + 1) % V  # the last is drawn from, not conditioned on
    assert torch.equal(captured.rows(ids, valid)[0], captured.rows(item["input_ids"], valid)[0])
    ids = item["input_ids"].clone()
    ids[0] = (ids[0] + 1) % V  # another prompt
    assert captured.rows(ids, valid) is None
    assert captured.rows(item["input_ids"], valid)[0].shape == (int(valid.sum()), 8)
    assert len(CapturedOutputs([out], 16, V)) == 0  # captured at another N: not served
    fresh = CapturedOutputs([out], 8, V)  # why a sequence is not served, counted
    assert fresh.rows(ids, valid) is None
    ids = item["input_ids"].clone()
    ids[trained[0]] = (ids[trained[0]] + 1) % V
    assert fresh.rows(ids, valid) is None
    longer = torch.cat([item["input_ids"], item["input_ids"][-1:].repeat(40)])
    assert fresh.rows(longer, torch.cat([valid, torch.ones(40, dtype=torch.bool)])) is None
    assert fresh.missed == {
        "no kept prompt": 1,
        "tokenized otherwise than generated": 1,
        "more tokens than were generated": 1,
    }


def test_a_lost_capture_costs_a_forward_only(tiny_pair, word_target, tmp_path):
    training, out = _answered(tiny_pair, word_target, tmp_path)
    parts = sorted((out / CAPTURED).glob("part-*.safetensors"))
    assert len(parts) >= 1
    parts[-1].unlink()  # killed after the answers were written, before their capture
    if len(parts) > 1:
        parts[0].write_bytes(parts[0].read_bytes()[:100])  # a damaged part
    assert len(CapturedOutputs([out], V, V).unreadable) == (len(parts) > 1)
    build = dict(top_n=V, values_dtype="float32", splits=("train",), print=lambda *a: None)
    made = build_cache(training, tmp_path / "c", captured=CapturedOutputs([out], V, V), **build)
    build_cache(training, tmp_path / "l", **build)
    assert made["splits"]["train"]["captured"]["computed"] >= 1
    _assert_same_rows(tmp_path / "c", tmp_path / "l")


def test_a_capture_refuses_a_cache_of_other_columns(tiny_pair, word_target, tmp_path):
    from specdistill.train.target_cache import CacheError

    training, out = _answered(tiny_pair, word_target, tmp_path, top_n=8, dtype="float16")
    with pytest.raises(CacheError, match="hold the top 8"):
        build_cache(training, tmp_path / "c", top_n=16, captured=CapturedOutputs([out], 8, V))


def test_prepare_keeps_the_top_n_while_answering_and_distill_trains_from_it(
    tiny_pair, word_target, tmp_path, monkeypatch
):
    """`prepare.top_n` with target.cache: the answers' top N are kept while answering, the
    cache (top-N, for a draft over a reduced vocabulary too) is read from them with a forward
    only for the sequences they do not serve, a rerun keeps it, and distill trains on it."""
    from specdistill.train import prepare as prepare_verb
    from specdistill.train.distill import main as distill
    from specdistill.train.target_cache_vocab import cache_columns

    out, held_out, cache = tmp_path / "answers", tmp_path / "held-out", tmp_path / "cache"
    extra = {
        "target.model": str(word_target),
        "target.cache": str(cache),
        "draft.model": "target-layers:1",
        "draft.vocab_size": 20,
        "data.train": f"{out}/regen-*.jsonl",
        "data.eval": f"{held_out}/regen-*.jsonl",
        "data.max_length": 64,
        "data.pack": "false",
        "prepare.train.prompts": str(_prompts(tmp_path)),
        "prepare.train.out": str(out),
        "prepare.eval.prompts": str(_prompts(held_out.parent / "asked", n=4)),
        "prepare.eval.out": str(held_out),
        "prepare.max_new_tokens": 12,
        "prepare.temperature": 1.0,
        "prepare.top_n": 8,
        "train.max_steps": 2,
    }
    argv = overrides(tiny_pair, tmp_path / "run", **extra)
    lines = []
    prepare_verb.prepare(load_recipe(None, argv), batch_size=3, print=lines.append)
    assert cache_columns(cache) == "top-n"
    manifest = json.loads((cache / "manifest.json").read_text())
    served = manifest["splits"]["train"]["captured"]
    sequences = manifest["splits"]["train"]["sequences"]
    assert served["served"] + served["computed"] == sequences and served["served"] >= sequences / 2
    assert manifest["top_n"] == 8 and "eval" not in manifest["splits"]
    assert not (held_out / CAPTURED).exists()  # held-out answers are not trained on
    assert any("top 8 kept" in line for line in lines)
    forwards = _forwards(monkeypatch)
    prepare_verb.prepare(load_recipe(None, argv), batch_size=3, print=lines.append)
    assert forwards == [] and "serve this data: kept" in lines[-1]
    monkeypatch.undo()
    assert distill(argv) == 0


@pytest.mark.parametrize("kind", ["eagle3", "parallel"])
def test_prepare_top_n_is_refused_for_a_draft_that_needs_its_own_columns(tiny_pair, tmp_path, kind):
    from specdistill.train.recipe_errors import RecipeError
    from tests.train.helpers import prepare_overrides

    extra = {"draft.type": kind, "draft.vocab_size": 50, "target.cache": str(tmp_path / "c")}
    if kind == "eagle3":
        extra.update({"draft.model": "null", "draft.aux_layers": "[0, 1]"})
    argv = prepare_overrides(tiny_pair, tmp_path, **extra, **{"prepare.top_n": 8})
    with pytest.raises(RecipeError, match="prepare.top_n"):
        load_recipe(None, argv)


def test_each_answer_carries_the_ids_the_target_drew(tiny_pair, word_target, tmp_path):
    from transformers import AutoTokenizer

    _, out = _answered(tiny_pair, word_target, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(word_target)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [json.loads(line) for p in sorted(out.glob("regen-*.jsonl")) for line in p.open()]
    assert len(rows) == 16
    for row in rows:
        prompt = tokenizer.apply_chat_template(
            row["messages"][:-1], tokenize=False, add_generation_prompt=True
        )
        ids = row["token_ids"]
        assert ids["prompt"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = ids["answer"]  # up to its end token, or one past the 12 written
        assert answer[-1] == end or len(answer) == 13
        assert end not in answer[:-1]
        text = tokenizer.decode(answer, skip_special_tokens=True)
        assert text.startswith(row["messages"][-1]["content"])
