"""`specdistill serve --target-adapter`: a fine-tuned target (base + peft LoRA, unmerged)."""

import openai
import pytest
from transformers import AutoTokenizer

from specdistill.formats.traffic_shards import read_traffic
from specdistill.models import hub
from specdistill.models.identity import model_identity
from tests.helpers import hf_greedy

PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):"]


@pytest.fixture(scope="module")
def adapter_server(tiny_pair, tiny_adapter, tmp_path_factory):
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    target, draft, _ = tiny_pair
    traffic = tmp_path_factory.mktemp("traffic_adapter")
    srv = Server(
        ServeOptions(
            target=str(target),
            draft=str(draft),
            gamma=3,
            max_num_seqs=4,
            traffic=str(traffic),
            served_model_name="tiny",
            target_adapter=str(tiny_adapter),
        )
    )
    url = srv.start()
    yield url, srv
    srv.stop()


def test_greedy_equals_the_adapter_models_generate(tiny_pair, tiny_adapter, adapter_server):
    """Greedy over HTTP is the base + adapter model's own greedy decode (peft, HF generate),
    which differs from the bare base's; the traffic records carry base + adapter's identity."""
    target = str(tiny_pair[0])
    tok = AutoTokenizer.from_pretrained(target)
    tuned = hub.load_target(target, str(tiny_adapter)).eval()
    base = hub.load_model(target).eval()
    url, srv = adapter_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    differs = False
    ids_by_response = {}
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        expected = hf_greedy(tuned, tok, ids, 16)
        differs |= expected != hf_greedy(base, tok, ids, 16)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
        ids_by_response[r.id] = expected
    assert differs, "the adapter should change the target's greedy output"
    records = {r["id"]: r for r in read_traffic(srv.traffic.dir)}
    identity = model_identity(target, tuned, str(tiny_adapter))
    assert srv.state.config.target_identity == identity != model_identity(target, base)
    for rid, expected in ids_by_response.items():
        assert records[rid]["completion_token_ids"] == expected
        assert records[rid]["target"]["identity"] == identity


def test_identity_covers_the_adapter_files(tiny_pair, tiny_adapter, tmp_path):
    """Base + adapter has another identity than the bare base, and changing one byte of the
    adapter's weights (same file names, same path) changes it again."""
    import shutil

    target = str(tiny_pair[0])
    bare = model_identity(target)
    tuned = model_identity(target, None, str(tiny_adapter))
    assert tuned != bare and tuned.startswith(bare + "+adapter:sha256:")
    copy = tmp_path / "adapter"
    shutil.copytree(tiny_adapter, copy)
    assert model_identity(target, None, str(copy)) == tuned  # the files, not the path
    weights = copy / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_identity(target, None, str(copy)) != tuned
    with pytest.raises(FileNotFoundError):
        model_identity(target, None, str(tmp_path / "missing"))


def test_cli_flag(tiny_pair, tiny_adapter, monkeypatch):
    """`specdistill serve --target-adapter A` hands A to the server."""
    from specdistill.serve import serve_cli
    from specdistill.serve import server as server_module

    seen = {}

    class Fake:
        def __init__(self, options, *, threads=None):
            seen["options"] = options

        def serve(self, host, port):
            pass

    monkeypatch.setattr(server_module, "Server", Fake)
    serve_cli.main(
        ["--target", str(tiny_pair[0]), "--target-adapter", str(tiny_adapter), "--draft", "none"]
    )
    assert seen["options"].target_adapter == str(tiny_adapter)
    assert seen["options"].target == str(tiny_pair[0]) and seen["options"].draft == "none"
