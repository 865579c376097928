"""The online demo's summary figures on synthetic record streams (no models, no server)."""

import random

import pytest

GAMMA = 4


def record(t: float, category: str, version: str, alpha: float, rng: random.Random) -> dict:
    """A served record whose speculative counters come from i.i.d. acceptance `alpha`."""
    steps, accepted = 8, 0
    for _ in range(steps):
        k = 0
        while k < GAMMA and rng.random() < alpha:
            k += 1
        accepted += k
    return {
        "time": t,
        "category": category,
        "draft_version": version,
        "speculative": {
            "num_spec_steps": steps,
            "num_draft_tokens": steps * GAMMA,
            "num_accepted_draft_tokens": accepted,
        },
    }


def stream(segments, seed: int = 0):
    """`segments`: (n records, category, version, alpha), one record per second from t=0."""
    rng, out, t = random.Random(seed), [], 0.0
    for n, category, version, alpha in segments:
        for _ in range(n):
            out.append(record(t, category, version, alpha, rng))
            t += 1.0
    return out


def figures(records, starts, promotions, decisions, size=60):
    from specdistill.online_demo.report import Bootstrap, shift_figures

    return shift_figures(records, starts, promotions, decisions, size, Bootstrap(400, 0.95, 0))


def test_a_drop_a_recovery_and_the_old_domain_held():
    records = stream(
        [
            (30, "code", "v000001", 0.55),  # the start of the code phase: not the pre-shift level
            (90, "code", "v000002", 0.75),
            (100, "prose", "v000002", 0.50),  # t = 120: the shift
            (60, "prose", "v000003", 0.62),  # promoted at t = 220, still below 95%
            (150, "prose", "v000004", 0.76),  # promoted at t = 280 after a rejected refresh
            (120, "code", "v000004", 0.75),  # t = 430: back to code
        ]
    )
    promotions = [(29.5, "v000002"), (219.5, "v000003"), (279.5, "v000004")]
    decisions = [29.5, 219.5, 250.0, 279.5]
    f = figures(records, [0.0, 119.5, 429.5], promotions, decisions)

    assert f.before_shift.records == f.after_shift.records == f.after_return.records == 60
    assert set(f.before_shift.by_version) == {"v000002"}  # the last window, not the phase
    assert f.before_shift.alpha == pytest.approx(0.75, abs=0.05)
    assert f.after_shift.alpha == pytest.approx(0.50, abs=0.05)
    lo, hi = f.before_shift.interval
    assert lo < f.before_shift.alpha < hi
    assert f.drop.delta == pytest.approx(f.before_shift.alpha - f.after_shift.alpha)
    assert f.drop.delta > 0.15 and f.drop.interval[0] > 0.05  # the interval excludes zero

    r = f.recovery
    assert r.recovered and r.version == "v000004" and r.first_promotion == "v000003"
    assert r.alpha >= r.threshold == pytest.approx(0.95 * f.before_shift.alpha)
    assert r.refreshes_after_first_promotion == 2  # the rejected one and v000004's
    assert 160 < r.records <= 310 and r.seconds == pytest.approx(r.end - 119.5)
    assert r.end >= 280  # v000004 serves most of the window

    assert f.after_return.alpha == pytest.approx(0.75, abs=0.05)
    lo, hi = f.original_domain_change.interval
    assert lo < 0 < hi  # held: no change the interval can tell from zero
    assert f.as_dict()["drop"]["delta"] == f.drop.delta


def test_no_drop_gives_an_interval_around_zero_and_no_recovery_when_it_never_comes_back():
    same = stream([(100, "code", "v000001", 0.7), (100, "prose", "v000001", 0.7)], seed=1)
    f = figures(same, [0.0, 99.5, 1e9], [], [])
    assert f.drop.interval[0] < 0 < f.drop.interval[1]
    assert f.recovery.recovered and f.recovery.refreshes_after_first_promotion is None
    assert f.after_return.records == 0 and f.after_return.alpha is None
    assert f.original_domain_change.delta is None

    low = stream([(100, "code", "v000001", 0.8), (200, "prose", "v000001", 0.4)], seed=2)
    g = figures(low, [0.0, 99.5, 1e9], [(150.0, "v000002")], [150.0])
    assert not g.recovery.recovered and g.recovery.records is None
    assert g.recovery.first_promotion == "v000002"


def test_a_request_in_flight_at_the_shift_keeps_its_domain():
    """A code request that completes after the prose phase began is not in the first prose
    window (nor in the pre-shift one: it completed after the shift)."""
    records = stream([(80, "code", "v000001", 0.8), (80, "prose", "v000001", 0.4)], seed=3)
    late_code = record(80.2, "code", "v000001", 0.8, random.Random(0))
    f = figures([*records, late_code], [0.0, 80.0, 1e9], [], [], size=40)
    assert f.after_shift.records == 40
    assert f.after_shift.start == 80.0 and f.after_shift.end == 119.0
    assert f.before_shift.end == 79.0


def test_the_plot_marks_the_windows(tmp_path):
    from specdistill.online_demo.report import plot

    records = stream([(80, "code", "v000001", 0.8), (80, "prose", "v000001", 0.4)])
    f = figures(records, [0.0, 80.0, 1e9], [], [], size=40)
    plot(tmp_path / "a.png", records, [0.0, 80.0, 1e9], [(100.0, "v000002")], 20, f)
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_the_prompt_pool_cuts_several_prompts_per_text_interleaved():
    from specdistill.online_demo.loadgen import prompts_of

    def tokenizer(text):
        return {"input_ids": [int(w) for w in text.split()]}

    long = " ".join(str(i) for i in range(100, 140))  # 40 ids
    short = " ".join(str(i) for i in range(10))  # 10 ids: one prompt
    pool = prompts_of([long, short], tokenizer, prompt_tokens=8, per_text=4)
    first = list(range(100, 108))
    assert pool[:2] == [first, list(range(8))]  # every text's first prompt, then the next
    assert pool[2:] == [list(range(104 + 4 * k, 112 + 4 * k)) for k in range(3)]
    assert prompts_of([long], tokenizer, 8, 1) == [first]
