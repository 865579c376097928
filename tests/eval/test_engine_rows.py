"""eval.engine.Engine, the server's engine: requests joining over time, per-request sampling
and seeds, cancellation."""

import torch

from specdistill.eval.engine import Engine, Sampling
from tests.eval.helpers import perturbed, reference_greedy, tiny_llama


def _pair():
    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    return target, perturbed(target, 0.015, seed=1)


def _run(engine, ids):
    out = {r: [] for r in ids}
    while engine.busy:
        for u in engine.step():
            out[u.request] += u.tokens
    return [out[r] for r in ids]


def test_requests_join_a_running_batch_and_stay_greedy_exact():
    target, draft = _pair()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 11, 6, 1, 8)]
    engine = Engine(target, draft, gamma=3, capacity=3)
    out = {}
    ids = [engine.add(p, max_new_tokens=16) for p in prompts[:2]]
    for _ in range(3):  # the first two decode for a few rounds before the others arrive
        for u in engine.step():
            out.setdefault(u.request, []).extend(u.tokens)
    ids += [engine.add(p, max_new_tokens=16) for p in prompts[2:]]
    while engine.busy:
        for u in engine.step():
            out.setdefault(u.request, []).extend(u.tokens)
    assert [out[r] for r in ids] == [reference_greedy(target, p, 16) for p in prompts]


def test_seeded_request_does_not_depend_on_its_batch():
    target, draft = _pair()
    prompt = [5, 17, 33, 2]
    alone = Engine(target, draft, gamma=3, capacity=4)
    r = alone.add(prompt, max_new_tokens=20, sampling=Sampling(1.0, top_p=0.9, seed=11))
    (expected,) = _run(alone, [r])
    crowd = Engine(target, draft, gamma=3, capacity=4)
    others = [
        crowd.add([1, 2, 3], max_new_tokens=30, sampling=Sampling(0.5, seed=1)),
        crowd.add([9] * 7, max_new_tokens=5),
    ]
    crowd.step()
    r = crowd.add(prompt, max_new_tokens=20, sampling=Sampling(1.0, top_p=0.9, seed=11))
    got = _run(crowd, [r, *others])[0]
    assert got == expected


def test_cancel_frees_the_row():
    target, draft = _pair()
    engine = Engine(target, draft, gamma=2, capacity=2)
    a = engine.add([1, 2, 3], max_new_tokens=50)
    b = engine.add([4, 5], max_new_tokens=6)
    engine.step()
    engine.cancel(a)
    seen = set()
    while engine.busy:
        seen |= {u.request for u in engine.step()}
    assert seen == {b} and not engine.batch.requests


def test_generate_returns_each_tokens_target_distribution_when_asked():
    """`generate(logprobs=k)`: one entry per generated token, with and without a draft, the
    target's raw log-softmax at the position that chose it (a teacher-forced forward's)."""
    import pytest

    from specdistill.eval.engine import generate

    target, draft = _pair()
    prompts = [[5, 9, 2], [7, 1, 4, 4, 30]]
    for d in (None, draft):
        gen = generate(
            target, d, prompts, temperature=1.0, max_new_tokens=9, batch_size=2, logprobs=4
        )
        for prompt, out, entries in zip(prompts, gen.sequences, gen.logprobs, strict=True):
            assert len(entries) == len(out) > 0
            ids = torch.tensor([prompt + out])
            with torch.no_grad():
                logp = target(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            for j, (chosen, alternatives) in enumerate(entries):
                assert chosen == pytest.approx(logp[j, out[j]].item(), abs=1e-4)
                top = logp[j].topk(4)
                assert [t for t, _ in alternatives] == top.indices.tolist()
    assert generate(target, None, prompts, max_new_tokens=2).logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        generate(target, None, prompts, max_new_tokens=2, logprobs=-1)
