r"""τ_pred against measured τ, in the training domain and off it (docs/theory.md §1, "Chains").

For a target and a draft, per domain (held-out text of the training data's kind; prompts from
elsewhere) and temperature: the target continues the prompts once (the texts every prediction
is made along), and then

- iid: the i.i.d. formula on the mean teacher-forced α along the texts (per depth for an
  EAGLE-3 head: chained), what training reports as tau_pred_iid;
- rounds: the rounds replayed along the texts with the teacher-forced α
  (`stats.tau_rounds_pooled`), training's tau_pred;
- chain (starts): 1 + Σ_k mean c_k over a chain of the draft's own from every start
  (eval/chain_tau.py), every start alike;
- chain (rounds): the rounds replayed with the chains' acceptance, training's tau_pred_chain
  (with eval.prompts); its SE by a bootstrap over the texts;

against measured τ (tokens per round of real speculative decoding, `eval.engine.generate`,
batch size 1, no EOS stop; SE from the per-round token counts, rounds taken as independent).
z = (chain (rounds) − τ) / √(SE_τ² + SE_chain²).

    python -m benchmarks.tau_pred_check --target embedded:code-deep --draft runs/code/final \
        --num-prompts 40 --max-new-tokens 96 --threads 1 --out runs/tau_pred_check/code.json

Writes the rows to --out (JSON) and, with --results, its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks import results
from benchmarks.tau_table import tau_standard_error
from specdistill import drafts
from specdistill.data.dataset import build_datasets
from specdistill.eval import stats
from specdistill.eval.chain_tau import first_start, summarise_chains, text_survival
from specdistill.eval.engine import generate
from specdistill.eval.offline import held_out_texts
from specdistill.eval.prompts import encode_prompts, load_prompts
from specdistill.models import hub
from specdistill.train.recipe_draft import draft_section
from specdistill.verb_parser import quiet_third_party

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP = 200  # resamples of the texts for the chain figure's SE
TOLERANCE = 0.03


def load_pair(args):
    """(tokenizer, target, draft module, its draft type instance): the draft loaded as a
    recipe's `draft.model` is (`drafts.build`), which gives the type its instance."""
    tokenizer = hub.load_tokenizer(args.target)
    target = hub.load_target(args.target, None).eval()
    cfg = draft_section({"type": drafts.detect(args.draft).name, "model": args.draft})
    draft, kind = drafts.build(cfg, target, tokenizer, None, print=lambda *a, **k: None)
    return tokenizer, target, draft.eval(), kind


def domain_prompts(args, tokenizer) -> dict[str, list[list[int]]]:
    """{domain: prompt ids}: the first --prompt-tokens tokens of --num-prompts held-out
    sequences of --in-domain, and the first --num-prompts prompts of --prompts (their last
    --max-prompt-tokens tokens)."""
    _, held = build_datasets(tokenizer, args.in_domain, args.in_domain, max_length=256, pack=True)
    n = min(args.num_prompts, len(held))
    inside = [held[i]["input_ids"][: args.prompt_tokens].tolist() for i in range(n)]
    outside = encode_prompts(
        load_prompts(args.prompts, limit=args.num_prompts), tokenizer, args.max_prompt_tokens
    )
    return {args.in_domain: inside, Path(args.prompts).name: outside}


def teacher_forced(target, draft, kind, prompts, texts, temperature, max_gamma) -> list:
    """Offline α along each text (`stats.positional_alpha`; per depth up to max_gamma)."""
    depth = max_gamma if kind.per_depth_alpha else 1
    return [
        stats.positional_alpha(target, draft, p, o, temperature=temperature, depth=depth)
        for p, o in zip(prompts, texts, strict=True)
    ]


def iid_tau(alphas: list, gamma: int, per_depth: bool) -> float:
    """The i.i.d. formula on the mean α (per depth: `tau_chain` of the depths' means)."""
    if not per_depth:
        values = [a for text in alphas for a in text]
        return stats.tau_iid(sum(values) / len(values), gamma)
    depths = len(alphas[0])
    means = [sum(sum(t[k]) for t in alphas) / sum(len(t[k]) for t in alphas) for k in range(depths)]
    return stats.tau_chain(means, gamma)


def chain_bootstrap(survivals, lengths, first, max_gamma, seed) -> dict[int, float]:
    """SE of the round-aware chain figure per γ over BOOTSTRAP resamples of the texts."""
    picks = stats.bootstrap_indices(len(survivals), BOOTSTRAP, seed)
    values: dict[int, list[float]] = {g: [] for g in range(1, max_gamma + 1)}
    for row in picks:
        tau = summarise_chains(
            [survivals[i] for i in row],
            [lengths[i] for i in row],
            first=first,
            max_gamma=max_gamma,
        )
        for g, v in tau.rounds.items():
            values[g].append(v)
    return {g: float(torch.tensor(v, dtype=torch.float64).std()) for g, v in values.items() if v}


def measure(target, draft, prompts, gamma, temperature, args) -> dict:
    """Measured τ of real speculative decoding at γ: {tau, se, rounds, seconds}."""
    start = time.perf_counter()
    out = generate(
        target,
        draft,
        prompts,
        gamma=gamma,
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=1,
    )
    entry = {**stats.acceptance_stats(out.rounds), "gamma": gamma}
    return {
        "tau": entry["tau"],
        "se": tau_standard_error(entry),
        "rounds": entry["row_rounds"],
        "seconds": time.perf_counter() - start,
    }


def predictions(pair, prompts, temperature, args) -> dict:
    """Every prediction along the target's continuations of `prompts` at `temperature`."""
    _, target, draft, kind = pair
    texts = held_out_texts(
        target, prompts, temperature=temperature, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    top = max(args.gammas)
    alphas = teacher_forced(target, draft, kind, prompts, texts, temperature, top)
    start = time.perf_counter()
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    survivals = [
        text_survival(
            kind, target, draft, p, o, max_gamma=top, temperature=temperature, generator=generator
        )
        for p, o in zip(prompts, texts, strict=True)
    ]
    chain_s = time.perf_counter() - start
    lengths, first = [len(o) for o in texts], first_start(kind)
    chain = summarise_chains(survivals, lengths, first=first, max_gamma=top)
    return {
        "iid": {g: iid_tau(alphas, g, kind.per_depth_alpha) for g in args.gammas},
        "rounds": {g: stats.tau_rounds_pooled(alphas, g) for g in args.gammas},
        "chain_starts": chain.starts,
        "chain_starts_se": chain.starts_se,
        "chain_rounds": chain.rounds,
        "chain_rounds_se": chain_bootstrap(survivals, lengths, first, top, args.seed),
        "chain_seconds": chain_s,
        "n_chains": chain.n_chains,
    }


def rows_for(pair, domain: str, prompts, temperature: float, args) -> list[dict]:
    """One row per γ of a (domain, temperature) cell."""
    _, target, draft, _ = pair
    pred = predictions(pair, prompts, temperature, args)
    out = []
    for g in args.gammas:
        m = measure(target, draft, prompts, g, temperature, args)
        row = {"domain": domain, "prompts": len(prompts), "temperature": temperature, "gamma": g}
        row |= {f"measured_{k}": v for k, v in m.items()}
        for name in ("iid", "rounds", "chain_starts", "chain_rounds"):
            value = pred[name].get(g, math.nan)
            row[f"pred_{name}"] = value
            row[f"err_{name}"] = (value - m["tau"]) / m["tau"]
        se = math.hypot(m["se"], pred["chain_rounds_se"].get(g, math.nan))
        row["chain_rounds_se"] = pred["chain_rounds_se"].get(g, math.nan)
        row["chain_starts_se"] = pred["chain_starts_se"].get(g, math.nan)
        row["z_chain_rounds"] = (row["pred_chain_rounds"] - m["tau"]) / se if se else math.nan
        row["chain_seconds"], row["n_chains"] = pred["chain_seconds"], pred["n_chains"]
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _num(x: float, digits: int = 3) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    if math.isnan(x):
        return "–"
    return f"{100 * x:+.1f}%" + ("" if abs(x) <= TOLERANCE else " ✗")


HEADER = [
    "domain",
    "T",
    "γ",
    "rounds",
    "τ measured ± SE",
    "iid",
    "err",
    "rounds",
    "err",
    "chain (starts)",
    "err",
    "chain (rounds) ± SE",
    "err",
    "z",
]


def table(rows: list[dict]) -> str:
    cells = [
        [
            f"{r['domain']} ({r['prompts']})",
            f"{r['temperature']:g}",
            r["gamma"],
            r["measured_rounds"],
            f"{_num(r['measured_tau'])} ± {_num(r['measured_se'])}",
            _num(r["pred_iid"]),
            _pct(r["err_iid"]),
            _num(r["pred_rounds"]),
            _pct(r["err_rounds"]),
            _num(r["pred_chain_starts"]),
            _pct(r["err_chain_starts"]),
            f"{_num(r['pred_chain_rounds'])} ± {_num(r['chain_rounds_se'])}",
            _pct(r["err_chain_rounds"]),
            _num(r["z_chain_rounds"], 1),
        ]
        for r in rows
    ]
    lines = [results.markdown_table(HEADER, cells), ""]
    for domain in dict.fromkeys(r["domain"] for r in rows):
        mine = [r for r in rows if r["domain"] == domain]
        counts = ", ".join(
            f"{name} {sum(abs(r[f'err_{name}']) <= TOLERANCE for r in mine)}/{len(mine)}"
            for name in ("iid", "rounds", "chain_starts", "chain_rounds")
        )
        lines.append(f"Within ±{TOLERANCE:.0%} on {domain}: {counts}.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="embedded:code-deep")
    parser.add_argument("--draft", default="runs/code/final")
    parser.add_argument("--in-domain", default="embedded:code-heldout", help="held-out data")
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/prompts/HumanEval.jsonl.gz"))
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=32, help="in-domain prompt length")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gammas", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--domains", default="both", choices=("both", "in", "out"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="runs/tau_pred_check/tau_pred_check.json")
    parser.add_argument("--note", default="", help="a sentence for the RESULTS.md section")
    results.add_argument(parser)
    return parser


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    args.gammas = [int(g) for g in args.gammas.split(",")]
    quiet_third_party()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args)
    domains = domain_prompts(args, pair[0])
    keep = {"both": (0, 1), "in": (0,), "out": (1,)}[args.domains]
    rows = []
    for i, (domain, prompts) in enumerate(domains.items()):
        if i in keep:
            for t in (float(x) for x in args.temperatures.split(",")):
                rows += rows_for(pair, domain, prompts, t, args)
    text = table(rows)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "results"}
    out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    if args.results:
        body = (
            f"Target {args.target}, draft {args.draft}; {args.max_new_tokens} new tokens per "
            f"prompt, batch size 1, seed {args.seed}. {args.note}\n\n{text}\n"
        )
        section = results.Section("tau_pred_check", "τ_pred off the training domain", body)
        print(f"wrote {results.write(section, args.results)}")
    return rows


if __name__ == "__main__":
    main()
