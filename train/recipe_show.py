"""Print a recipe resolved: its parents (`extends:`) merged, the overrides applied, every key
with its value and where the value came from.

    specdistill recipe show recipes/smollm2-eagle3.yaml
    specdistill recipe show code train.max_steps=50 loss.name=tv

The output is YAML (loadable as a recipe: the same values) with a comment after each value:
`# file:line` of the recipe file or parent that wrote it, `# override` for a `key.sub=value`
override, `# default` for the schema's default (docs/recipe-keys.md). The recipe is checked
first: an unknown key or a bad value prints one `recipe error:` line and exits 2.
"""

import argparse
import json
import sys

import yaml

from specdistill.errors import run_guarded
from specdistill.verb_parser import verb_parser

ACTIONS = ("show",)
COMMENT_COLUMN = 48  # comments line up here unless a line is longer


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("recipe", __doc__)
    parser.add_argument("action", choices=ACTIONS, help="show: print the resolved recipe")
    parser.add_argument(
        "recipe", help="YAML recipe file, or a shipped recipe's name (e.g. code, smollm2-eagle3)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides (docs/recipe-keys.md)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specdistill.train.config import resolve_recipe  # lazy: --help loads no pydantic

    sys.stdout.write(render(resolve_recipe(args.recipe, args.overrides)))
    return 0


def render(resolved) -> str:
    """The resolved recipe (train/config.py `ResolvedRecipe`) as commented YAML."""
    from specdistill.train.config import recipe_to_dict  # lazy: --help loads no pydantic

    rows: list[tuple[str, str | None]] = []  # (text, origin or None for a section line)
    _rows(recipe_to_dict(resolved.recipe), "", 0, resolved, rows)
    width = min(COMMENT_COLUMN, max(len(text) for text, origin in rows if origin))
    files = list(dict.fromkeys(str(f) for f in resolved.files)) or ["(no file: the defaults)"]
    lines = [f"# resolved from {', '.join(files)}"]
    if resolved.overridden:
        lines.append(f"# overrides: {', '.join(resolved.overridden)}")
    for text, origin in rows:
        lines.append(f"{text:<{width}}  # {origin}" if origin else text)
    return "\n".join(lines) + "\n"


def _rows(section: dict, prefix: str, depth: int, resolved, rows: list) -> None:
    from specdistill.train.recipe_files import SECTIONS  # lazy: --help loads no pydantic

    for key, value in section.items():
        dotted = f"{prefix}{key}"
        text = f"{'  ' * depth}{_yaml(key)}:"
        if isinstance(value, dict) and dotted in SECTIONS:
            rows.append((text, None))
            _rows(value, f"{dotted}.", depth + 1, resolved, rows)
        else:
            rows.append((f"{text} {_yaml(value)}", resolved.origin(dotted)))


def _yaml(value) -> str:
    """`value` as YAML on one line (flow style; JSON, which is YAML, for multi-line text)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=2**31, allow_unicode=True)
    text = text.removesuffix("\n...\n").rstrip("\n")
    return json.dumps(value, ensure_ascii=False) if "\n" in text else text


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
