"""A server on the tiny pair (tests/conftest.py), started on 127.0.0.1 in a thread; a published
root of drafts; the tiny target as traffic records name it."""

import pytest

from tests.helpers import make_model, make_tokenizer


@pytest.fixture(scope="session")
def published(tiny_pair, tmp_path_factory):
    """A published root: v000001 = the tiny draft, v000002 = a second (perturbed) draft of
    the same tokenizer, v000003 = broken (config.json only); current -> v000001."""
    import shutil

    from specdistill.publish import atomic_write_text

    target, draft, _ = tiny_pair
    root = tmp_path_factory.mktemp("published")
    shutil.copytree(draft, root / "v000001")
    (root / "v000001" / "manifest.json").write_text('{"version": "v000001"}')
    tokenizer = make_tokenizer()
    other = make_model(tokenizer, hidden=16, layers=1, seed=7)
    other.save_pretrained(root / "v000002")
    tokenizer.save_pretrained(root / "v000002")
    (root / "v000002" / "manifest.json").write_text('{"version": "v000002"}')
    (root / "v000003").mkdir()
    (root / "v000003" / "config.json").write_text('{"model_type": "llama", "broken": ')
    (root / "v000003" / "manifest.json").write_text('{"version": "v000003"}')
    atomic_write_text(root / "current", "v000001\n")
    return root


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    """(base URL, Server) with the tiny draft, a traffic log and top-3 logprobs logged."""
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    target, draft, _ = tiny_pair
    traffic = tmp_path_factory.mktemp("traffic")
    srv = Server(
        ServeOptions(
            target=str(target),
            draft=str(draft),
            gamma=3,
            max_num_seqs=4,
            traffic=str(traffic),
            log_top_logprobs=3,
            served_model_name="tiny",
            max_model_len=4096,
        )
    )
    url = srv.start()
    yield url, srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture
def traffic_target(tiny_pair):
    """(path, tokenizer, the records' `target` field) of the tiny target, for conversion."""
    from specdistill.models.hub import load_tokenizer
    from specdistill.models.identity import model_identity

    path = str(tiny_pair[0])
    return path, load_tokenizer(path), {"name": path, "identity": model_identity(path)}
