import re
from pathlib import Path

import pytest

from specdistill.train.config import Recipe, RecipeError, dump_recipe, load_recipe, parse_override

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    recipe = load_recipe(None)
    assert recipe == Recipe()
    assert recipe.target.model == "embedded:code-deep"
    assert recipe.draft.model == "embedded:code-deep-draft"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_is_valid(path):
    recipe = load_recipe(path)
    assert recipe.train.max_steps >= 1
    assert recipe.target.model
    assert recipe.draft.model or recipe.draft.type == "eagle3"  # null: a fresh head


def test_shipped_recipes_found():
    names = {p.name for p in RECIPES}
    assert {"code.yaml", "qwen2.5-coder-7b.yaml"} <= names


def test_overrides_are_typed_and_nested(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 10\nloss:\n  name: tv\n")
    recipe = load_recipe(
        path,
        [
            "train.max_steps=50",
            "loss.name=lk_lambda",
            "loss.eta=5",
            "data.train=a.jsonl",
            "eval.temperature=0",
            "wandb.project=null",
            "draft.lora.r=8",
        ],
    )
    assert recipe.train.max_steps == 50
    assert recipe.loss.name == "lk_lambda" and recipe.loss.params == {"eta": 5}
    assert recipe.data.train == ["a.jsonl"]
    assert recipe.eval.temperature == 0.0 and isinstance(recipe.eval.temperature, float)
    assert recipe.draft.lora.r == 8


def test_every_loss_of_the_library_is_accepted():
    from specdistill import losses

    for name in sorted(set(losses.LOSSES) - {"mix"}):
        assert load_recipe(None, [f"loss.name={name}"]).loss.name == name
    mix = load_recipe(None, ["loss.name=mix", "loss.parts={tv: 0.9, fkl: 0.1}"])
    assert mix.loss.params == {"parts": {"tv": 0.9, "fkl": 0.1}}


def test_loss_params_nested_or_flat_are_the_same(tmp_path):
    flat = load_recipe(write(tmp_path, "loss:\n  name: lk_lambda\n  eta: 2.0\n"))
    nested = load_recipe(None, ["loss.name=lk_lambda", "loss.params.eta=2.0"])
    assert flat.loss == nested.loss


def test_unknown_key_names_it_and_suggests(tmp_path):
    with pytest.raises(
        RecipeError, match=r"unknown recipe key 'train.max_step'; did you mean 'train.max_steps'"
    ):
        load_recipe(None, ["train.max_step=5"])
    with pytest.raises(RecipeError, match=r"unknown recipe key 'trian'"):
        load_recipe(write(tmp_path, "trian:\n  max_steps: 5\n"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=0", r"train.max_steps must be >= 1, got 0"),
        ("train.max_steps=ten", r"train.max_steps must be an integer, got 'ten'"),
        ("train.lr=-1", r"train.lr must be > 0"),
        ("train.global_batch_size=12", r"must be a multiple of train.micro_batch_size"),
        (
            "train.mixed_precision=fp8",
            r"train.mixed_precision must be one of no, bf16, fp16, got .fp8.",
        ),
        ("eval.temperature=-0.5", r"eval.temperature must be >= 0"),
        ("data.pack=maybe", r"data.pack must be true or false"),
        ("loss.name=nope", r"loss.name must be one of .*got .nope."),
        ("loss.eta=-1", r"loss: .*eta"),
        ("loss.beta=0.5", r"loss: .*beta"),  # lk_lambda takes no beta
        ("loss.lambda_mode=sometimes", r"loss: .*lambda_mode"),
        (
            "target.dtype=float8",
            r"target.dtype must be one of float32, bfloat16, float16, got .float8.",
        ),
        ("loss.chunk_size=0", r"loss.chunk_size must be >= 1"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, [override])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="must look like key.sub=value"):
        parse_override("train.max_steps")
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(RecipeError, match="must be a mapping"):
        load_recipe(write(tmp_path, "- a\n- b\n"))


def test_dump_round_trip(tmp_path):
    recipe = load_recipe(None, ["loss.name=lk_lambda", "loss.eta=4.0", "train.max_steps=7"])
    dump_recipe(recipe, tmp_path / "out.yaml")
    assert load_recipe(tmp_path / "out.yaml") == recipe


def test_float_keys_accept_exponents_without_a_dot():
    """YAML 1.1 reads `1e-3` as a string; a float key still takes it, a word still fails."""
    assert load_recipe(None, ["train.lr=1e-3"]).train.lr == 1e-3
    with pytest.raises(RecipeError, match="train.lr must be a number"):
        load_recipe(None, ["train.lr=fast"])


def test_eagle3_keys_are_refused_when_set_even_to_their_defaults():
    """Detected by whether the user wrote them, not by comparing with the defaults."""
    with pytest.raises(RecipeError, match=r"draft.ttt_steps apply to draft.type=eagle3 only"):
        load_recipe(None, ["draft.ttt_steps=3"])  # 3 is the default
    with pytest.raises(RecipeError, match=r"draft.aux_layers, draft.freeze_lm_head apply"):
        load_recipe(None, ["draft.aux_layers=null", "draft.freeze_lm_head=false"])
    # draft.vocab_size also applies to a standalone draft (a reduced output vocabulary)
    assert load_recipe(None, ["draft.vocab_size=null"]).draft.vocab_size is None
    assert load_recipe(None, ["draft.type=eagle3", "draft.model=null", "draft.ttt_steps=3"])


def test_loss_parameters_checked_by_declaration_not_a_dummy_vocabulary():
    """topk_ce's k may exceed 1024 (a 128k vocabulary); declared ranges still apply."""
    assert load_recipe(None, ["loss.name=topk_ce", "loss.k=5000"]).loss.params == {"k": 5000}
    with pytest.raises(RecipeError, match=r"loss: topk_ce: loss.k must be >= 1, got 0"):
        load_recipe(None, ["loss.name=topk_ce", "loss.k=0"])
    with pytest.raises(RecipeError, match=r"loss: jsd: loss.beta must be in \[0, 1\], got 1.5"):
        load_recipe(None, ["loss.name=jsd", "loss.beta=1.5"])
    with pytest.raises(RecipeError, match=r"lambda_mode must be 'batch' or 'token'"):
        load_recipe(None, ["loss.name=lk_lambda", "loss.lambda_mode=tok"])


def test_enumerations_name_their_allowed_values():
    with pytest.raises(
        RecipeError,
        match=r"draft.type must be one of standalone, eagle3, parallel, got "
        r"'eagle'; did you mean 'eagle3'\?",
    ):
        load_recipe(None, ["draft.type=eagle"])
    with pytest.raises(RecipeError, match=r"wandb.mode must be one of offline, online, disabled"):
        load_recipe(None, ["wandb.mode=on"])


def test_a_shipped_recipe_by_name(tmp_path, monkeypatch):
    """`--recipe code` works from any directory (the recipes are package data)."""
    monkeypatch.chdir(tmp_path)
    assert load_recipe("code").train.output_dir == load_recipe("code.yaml").train.output_dir
    with pytest.raises(RecipeError, match=r"recipe file not found: cod \(shipped recipes: .*code"):
        load_recipe("cod")


# The schema is the one source: key sets, loss parameters and the reference doc come from it.


def test_key_sets_come_from_the_schema_marks():
    from specdistill.train.config import harmless_keys, own_keys
    from specdistill.train.run_plan import HARMLESS_KEYS

    assert own_keys() == {
        "standalone": set(),
        "eagle3": {
            "draft.aux_layers",
            "draft.ttt_steps",
            "draft.intermediate_size",
            "draft.norm_before_residual",
            "draft.freeze_lm_head",
        },
        "parallel": {"draft.parallel_depths"},
    }
    assert HARMLESS_KEYS == harmless_keys()
    outside = {
        k for k in HARMLESS_KEYS if not k.startswith(("eval.", "wandb.", "online.", "prepare."))
    }
    assert outside == {
        "train.save_every",
        "train.keep_checkpoints",
        "train.log_every",
        "train.resume",
        "train.overwrite",
        "train.output_dir",
        "train.threads",
    }
    assert {
        "eval.speculative.gammas",
        "wandb.mode",
        "online.policy",
        "prepare.train.limit",
    } <= HARMLESS_KEYS
    assert not HARMLESS_KEYS & {"train.seed", "train.max_steps", "loss.name", "data.train"}


def test_every_key_is_described():
    from specdistill.train.recipe import leaf_keys

    keys = leaf_keys()
    assert len(keys) > 100
    assert [k for k, field in keys.items() if not field.description] == []


def test_reference_doc_is_the_generated_one():
    """docs/recipe-keys.md is `python -m specdistill.train.recipe_docs` output: regenerate it
    after changing the schema."""
    from specdistill.train import recipe_docs

    committed = (Path(__file__).parents[2] / recipe_docs.DOC).read_text()
    assert committed == recipe_docs.render(), f"stale: run {recipe_docs.COMMAND}"
    for key in ("`train.max_steps`", "`draft.ttt_steps`", "`online.clients`", "`loss.eta`"):
        assert key in committed


def test_loss_parameters_are_read_from_the_library_once():
    from specdistill.losses.declaration import REQUIRED
    from specdistill.losses.divergences import declared_params, param_names

    jsd = declared_params("jsd")
    assert list(jsd) == ["top_p", "top_k", "mask_out_of_vocab", "beta"]
    assert jsd["beta"].type is float and jsd["beta"].default == 0.5
    assert declared_params("mix")["parts"].default is REQUIRED
    assert {"parts", "beta", "eta"} <= set(declared_params("mix", ["jsd", "lk_lambda"]))
    assert param_names("lk_lambda") == {"eta", "lambda_mode", "alpha_bar"}


def test_errors_point_at_the_file_line_unless_an_override_set_the_key(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 0\nloss:\n  name: jsd\n  bta: 0.3\n")
    at = re.escape(str(path))
    with pytest.raises(RecipeError, match=rf"^{at}:2: train.max_steps must be >= 1, got 0$"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=rf"^{at}:5: loss: jsd takes no parameter 'loss.bta'"):
        load_recipe(path, ["train.max_steps=3"])
    with pytest.raises(RecipeError, match=r"^loss: jsd takes no parameter 'loss.bta'"):
        load_recipe(path, ["train.max_steps=3", "loss.bta=0.5"])


@pytest.mark.parametrize(
    "override",
    [
        "train=3",
        "draft.lora=[1]",
        "loss.params=3",
        "data.train=[]",
        "data.train=[1]",
        "eval.speculative.gammas=[1, 0]",
        "online.clients=[alice]",
        "wandb.project=5",
        "train.resume=true",
        "loss.parts=3",
        "loss.top_p=high",
    ],
)
def test_messages_are_one_line_and_never_pydantic_text(override):
    overrides = ["loss.name=mix"] if override == "loss.parts=3" else []
    with pytest.raises(RecipeError) as info:
        load_recipe(None, [*overrides, override])
    message = str(info.value)
    assert "\n" not in message and override.split("=")[0].split(".")[-1] in message
    for pydantic_words in ("validation error", "Input should", "pydantic", "[type="):
        assert pydantic_words not in message


def test_nullable_keys_say_null_is_allowed():
    with pytest.raises(RecipeError, match=r"wandb.project must be a string or null, got 5"):
        load_recipe(None, ["wandb.project=5"])
    with pytest.raises(RecipeError, match=r"draft.vocab_size must be >= 1 or null, got 0"):
        load_recipe(None, ["draft.type=eagle3", "draft.model=null", "draft.vocab_size=0"])
    with pytest.raises(RecipeError, match=r"eval.speculative.gammas\[1\] must be >= 1, got 0"):
        load_recipe(None, ["eval.speculative.gammas=[1, 0]"])


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_round_trips(path, tmp_path):
    recipe = load_recipe(path)
    dump_recipe(recipe, tmp_path / "recipe.yaml")
    assert load_recipe(tmp_path / "recipe.yaml") == recipe


def test_resume_reads_yaml_false_as_no_and_refuses_true():
    assert load_recipe(None, ["train.resume=false"]).train.resume == "no"
    assert load_recipe(None, ["train.resume=no"]).train.resume == "no"
    assert load_recipe(None, ["train.resume=auto"]).train.resume == "auto"
    with pytest.raises(RecipeError, match=r"train.resume must be .*got true .*write auto"):
        load_recipe(None, ["train.resume=yes"])


def test_sections_copy_with_changes_like_the_online_job():
    """A section copy with changed values (the online job's constant schedule) keeps the rest."""
    recipe = load_recipe(None, ["train.lr=3e-4"])
    changed = recipe.train.model_copy(update={"warmup_steps": 0, "min_lr_ratio": 1.0})
    assert (changed.lr, changed.warmup_steps, changed.min_lr_ratio) == (3e-4, 0, 1.0)
    assert recipe.train.warmup_steps == 20
