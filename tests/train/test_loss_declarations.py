"""The recipe's loss section, its overrides and its reference (docs/recipe-keys.md) read each
loss's one declaration (`losses.declaration.LossSpec`): a loss declared in that one place
alone is a valid `loss.name`, its parameters are coerced, bounded and documented, and the
flags it declares decide what the recipe's cross-key checks allow."""

import pytest

from specdistill.losses.declaration import REQUIRED, SETTINGS, LossSpec, Param
from specdistill.losses.divergences import DECLARED
from specdistill.train import recipe_docs
from specdistill.train.config import load_recipe
from specdistill.train.recipe_errors import RecipeError
from tests.losses.common import outside

BOUNDED = [
    (name, param)
    for name, spec in DECLARED.items()
    for param in (*SETTINGS, *spec.params)
    if param.allowed
]


def default_cell(param: Param) -> str:
    if param.default is REQUIRED:
        return "required"
    words = {None: "null", True: "true", False: "false"}
    return f"`{words.get(param.default, param.default)}`"


def row_of(text: str, key: str) -> list[str]:
    """The cells of the reference's table row of `key`."""
    row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
    return [cell.strip() for cell in row.strip("|").split(" | ")]


@pytest.mark.parametrize("name, param", BOUNDED, ids=[f"{n}.{p.name}" for n, p in BOUNDED])
def test_a_value_outside_the_declared_bounds_names_the_recipe_key(name, param):
    value = outside(param)
    with pytest.raises(RecipeError) as caught:
        load_recipe(None, [f"loss.name={name}", f"loss.{param.name}={value}"])
    assert caught.value.key == f"loss.{param.name}"
    assert f"loss.{param.name} must be {param.allowed}, got " in str(caught.value)


def test_the_reference_lists_every_declared_parameter_as_declared():
    text = recipe_docs.render()
    assert row_of(text, "loss.name")[3] == ", ".join(f"`{name}`" for name in DECLARED)
    for name, spec in DECLARED.items():
        assert row_of(text, name)[1] == spec.doc.replace("|", "\\|")
        for param in spec.params:
            cells = row_of(text, f"loss.{param.name}")
            assert name in cells[1].split(", ")
            assert cells[3:] == [default_cell(param), param.allowed, param.doc]
    for param in SETTINGS:
        cells = row_of(text, f"loss.{param.name}")
        assert cells[1:2] + cells[3:] == [
            "every loss",
            default_cell(param),
            param.allowed,
            param.doc,
        ]


def stand_in(draft_logp, target_logp, *, width: float = 2.0, shape: str = "flat"):
    STAND_IN.check(width=width, shape=shape)
    return width * (draft_logp - target_logp).abs().sum(-1)


STAND_IN = LossSpec(
    stand_in,
    "a stand-in declared in one place only",
    (
        Param("width", float, 2.0, "the stand-in's width", gt=0, le=5),
        Param("shape", str, "flat", "the stand-in's shape", choices=("flat", "round")),
    ),
    end_to_end=True,
)


def test_a_loss_declared_in_one_place_is_validated_and_documented(monkeypatch):
    monkeypatch.setitem(DECLARED, "stand_in", STAND_IN)
    recipe = load_recipe(None, ["loss.name=stand_in", "loss.width=3", "loss.shape=round"])
    assert recipe.loss.params == {"width": 3.0, "shape": "round"}
    assert isinstance(recipe.loss.params["width"], float)
    for override, words in [
        ("loss.width=9", r"loss: stand_in: loss.width must be in \(0, 5\], got 9.0"),
        ("loss.width=wide", r"loss.width must be a number, got 'wide'"),
        ("loss.shape=square", r"loss.shape must be 'flat' or 'round', got 'square'"),
        ("loss.widht=1", r"stand_in takes no parameter 'loss.widht'; did you mean 'loss.width'"),
        ("loss.beta=0.5", r"stand_in takes no parameter 'loss.beta'"),
    ]:
        with pytest.raises(RecipeError, match=words):
            load_recipe(None, ["loss.name=stand_in", override])
    # a part of a composite, its parameter beside the other parts'
    mix = load_recipe(None, ["loss.name=mix", "loss.parts={stand_in: 1, jsd: 1}", "loss.width=1"])
    assert mix.loss.params == {"parts": {"stand_in": 1.0, "jsd": 1.0}, "width": 1.0}
    # its declared end_to_end flag, not its name, lets the recipe weigh depths end to end
    assert load_recipe(None, ["loss.name=stand_in", "loss.depth_weighting=end_to_end"])
    text = recipe_docs.render()
    assert row_of(text, "loss.name")[3].endswith("`tau`, `stand_in`")
    assert row_of(text, "stand_in")[1:] == [STAND_IN.doc, "`loss.width`, `loss.shape`"]
    assert row_of(text, "loss.width") == [
        "`loss.width`",
        "stand_in",
        "number",
        "`2.0`",
        "in (0, 5]",
        "the stand-in's width",
    ]
    assert row_of(text, "loss.shape")[1:5] == ["stand_in", "string", "`flat`", "'flat' or 'round'"]


def test_without_the_declaration_the_name_is_refused():
    assert "stand_in" not in DECLARED
    with pytest.raises(RecipeError, match=r"loss.name must be one of .*got 'stand_in'"):
        load_recipe(None, ["loss.name=stand_in"])
    with pytest.raises(RecipeError, match=r"set loss.name=tv"):
        load_recipe(None, ["loss.name=fkl", "loss.depth_weighting=end_to_end"])
