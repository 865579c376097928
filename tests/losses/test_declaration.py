"""Each loss is declared once (`losses.declaration.LossSpec` beside its function): the
function's parameters, its own argument checks and the library's treatment of it (a
composite, a chain objective, a ranking loss, the end-to-end form, the batch's mean α) all
come from that declaration, and no module outside the declarations compares a loss's name."""

import ast
import inspect

import pytest
import torch

from specdistill.losses import compute_loss
from specdistill.losses.declaration import REQUIRED, SETTINGS, LossSpec, Param
from specdistill.losses.divergences import DECLARED, LOSSES, spec_of
from specdistill.losses.resolved import resolve_loss, token_loss
from tests.losses.common import outside
from tests.package_modules import modules

DECLARATIONS = "specdistill.losses.divergences"  # the one module that names the losses


def bounded() -> list[tuple[str, Param]]:
    return [(name, p) for name, spec in DECLARED.items() for p in spec.params if p.allowed]


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_the_function_takes_exactly_the_declared_parameters(name):
    spec = DECLARED[name]
    keywords = [
        (p.name, p.default)
        for p in inspect.signature(spec.fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    ]
    assert keywords == [(p.name, p.default) for p in spec.params]
    assert spec.name == name and spec.doc and all(p.doc for p in spec.params)


def test_a_function_that_differs_from_its_declaration_is_refused():
    def stand_in(draft_logp, target_logp, *, width: float = 1.0):
        return draft_logp.sum(-1)

    with pytest.raises(TypeError, match="not the declared ones"):
        LossSpec(stand_in, "a stand-in", (Param("width", float, 2.0, "its width"),))
    with pytest.raises(TypeError, match="not the declared ones"):
        LossSpec(stand_in, "a stand-in")


def test_compute_loss_keywords_are_the_declared_settings():
    signature = inspect.signature(compute_loss).parameters
    for param in SETTINGS:
        assert signature[param.name].default == param.default


@pytest.mark.parametrize("name, param", bounded(), ids=[f"{n}.{p.name}" for n, p in bounded()])
def test_the_function_checks_its_arguments_by_its_declaration(name, param):
    spec = DECLARED[name]
    value = outside(param)
    if spec.chain:  # computed on chains (losses/tau.py): the declaration alone is checked
        with pytest.raises(ValueError, match=f"{name}: {param.name} must be"):
            spec.check(**{param.name: value})
        return
    draft, target = torch.randn(3, 5), torch.randn(3, 5)
    with pytest.raises(ValueError) as caught:
        compute_loss(name, draft, target, **{param.name: value})
    assert str(caught.value) == f"{name}: {param.name} must be {param.allowed}, got {value!r}"


@pytest.mark.parametrize("param", [p for p in SETTINGS if p.allowed], ids=lambda p: p.name)
def test_the_sampling_settings_are_checked_by_their_declaration(param):
    value = outside(param)
    with pytest.raises(ValueError, match=rf"^{param.name} must be .*, got {value!r}$"):
        compute_loss("tv", torch.randn(2, 4), torch.randn(2, 4), **{param.name: value})


def test_a_loss_is_treated_by_its_declared_flags_not_its_name():
    flags = {
        name: (spec.composite, spec.chain, spec.ranking, spec.end_to_end)
        for name, spec in DECLARED.items()
    }
    assert {n for n, f in flags.items() if f[0]} == {"mix"}
    assert {n for n, f in flags.items() if f[1]} == {"tau"}
    assert {n for n, f in flags.items() if f[2]} == {"ce", "topk_ce"}
    assert {n for n, f in flags.items() if f[3]} == {"tv"}
    assert set(LOSSES) == set(DECLARED) - {"tau"}
    loss = token_loss("mix", {"parts": {"ce": 1.0, "lk_lambda": 1.0}}, False)
    assert [(p.ranking, p.batch_alpha) for p in loss.parts] == [(True, False), (False, True)]
    token = token_loss("lk_lambda", {"lambda_mode": "token"}, False)
    assert not token.batch_alpha
    assert not token_loss("lk_lambda", {"alpha_bar": 0.5}, False).batch_alpha


def test_a_stand_in_loss_declared_once_is_resolved_by_its_flags(monkeypatch):
    def stand_in(draft_logp, target_logp, *, width: float = 2.0):
        STAND_IN.check(width=width)
        return width * (draft_logp - target_logp).abs().sum(-1)

    STAND_IN = LossSpec(
        stand_in,
        "a stand-in",
        (Param("width", float, 2.0, "its width", gt=0, le=5),),
        ranking=True,
        end_to_end=True,
    )
    monkeypatch.setitem(DECLARED, "stand_in", STAND_IN)
    draft, target = torch.randn(3, 5), torch.randn(3, 5)
    value, n = compute_loss("stand_in", draft, target, width=1.0)
    assert n == 3 and torch.isfinite(value)
    with pytest.raises(ValueError, match=r"stand_in: width must be in \(0, 5\], got 9.0"):
        compute_loss("stand_in", draft, target, width=9.0)
    mixed = token_loss("mix", {"parts": {"stand_in": 0.5, "tv": 0.5}, "width": 3.0}, False)
    assert [(p.name, p.ranking, dict(p.params)) for p in mixed.parts] == [
        ("stand_in", True, {"width": 3.0}),
        ("tv", False, {}),
    ]
    resolved = resolve_loss("stand_in", {}, weighting="end_to_end", decay=None, default_gamma=4)
    assert resolved.chain is None and resolved.depths.weighting == "end_to_end"


def test_unknown_names_and_required_parameters():
    with pytest.raises(ValueError, match="unknown loss 'kl'"):
        spec_of("kl")
    assert DECLARED["mix"].param("parts").default is REQUIRED
    with pytest.raises(ValueError, match="mix needs parts"):
        compute_loss("mix", torch.randn(2, 4), torch.randn(2, 4))


def strings_in(node: ast.AST | None) -> list[str]:
    """The string constants `node` is, or holds as a tuple, list or set."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def keyed_strings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, string) of every string constant that a comparison (==, !=, in, not in)
    compares with, or that a module-level constant holds (`CHAIN = "tau"`), directly or in
    a tuple, list or set: the ways a module keys on a name."""
    found = [
        (node.lineno, text)
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for text in strings_in(node.value)
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            found += [(node.lineno, text) for side in sides for text in strings_in(side)]
    return found


def test_no_module_but_the_declarations_keys_on_a_loss_name():
    names = set(DECLARED)
    found = [
        f"{module}:{line} keys on {text!r}"
        for module, path in modules().items()
        if module != DECLARATIONS
        for line, text in keyed_strings(ast.parse(path.read_text()))
        if text in names
    ]
    assert found == []
