"""Traffic completed by the tiny target of tests/conftest.py, shared by the online job's tests."""

import pytest
import torch

from tests.train.online.helpers import CODE, PROSE, make_record


@pytest.fixture(scope="session")
def traffic_pool(tiny_pair):
    """(identity, records): 96 records (code and prose) completed by the tiny target, greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdistill.models.identity import model_identity

    target_dir = str(tiny_pair[0])
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    identity = model_identity(target_dir, model)
    records = []
    for i in range(96):
        templates, category = (CODE, "code") if i % 3 else (PROSE, "prose")
        prompt = templates[i % len(templates)].format(i=i)
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        completion = out[0, len(ids) :].tolist()
        records.append(
            make_record(
                i,
                prompt,
                ids,
                completion,
                tok.decode(completion),
                identity,
                category=category,
                t=0.0 if i % 2 else 1.0,
            )
        )
    return identity, records
