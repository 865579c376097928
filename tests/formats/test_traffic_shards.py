"""The traffic log's shards as the readers see them: names, order, torn final lines, typed
records (formats/traffic_shards.py)."""

import json
import subprocess
import sys

import pytest

from specdistill.formats.traffic import TrafficError, TrafficRecord
from specdistill.formats.traffic_shards import (
    read_records,
    read_traffic,
    shard_index,
    shard_name,
    shards,
)
from tests.serve.helpers import record


def line(**changes) -> bytes:
    return (json.dumps(record(**changes)) + "\n").encode()


def test_a_shard_name_and_its_number_round_trip():
    assert shard_name(7) == "traffic-000007.jsonl"
    assert shard_index(shard_name(123456)) == 123456
    for other in ("traffic-7.jsonl", "traffic-000007.json", "xtraffic-000007.jsonl", "current"):
        assert shard_index(other) is None


def test_shards_are_listed_in_number_order_and_nothing_else(tmp_path):
    for i in (10, 2, 1):
        (tmp_path / shard_name(i)).write_bytes(b"")
    (tmp_path / "notes.jsonl").write_bytes(b"")
    assert [p.name for p in shards(tmp_path)] == [shard_name(i) for i in (1, 2, 10)]


def test_the_readers_skip_blank_lines_and_a_torn_final_line(tmp_path):
    (tmp_path / shard_name(1)).write_bytes(line(id="a") + b"\n  \n" + line(id="b"))
    (tmp_path / shard_name(2)).write_bytes(line(id="c") + line(id="d")[:-20])  # cut short
    assert [r["id"] for r in read_traffic(tmp_path)] == ["a", "b", "c"]
    typed = read_records(tmp_path)
    assert all(isinstance(r, TrafficRecord) for r in typed)
    assert [r.id for r in typed] == ["a", "b", "c"]
    assert typed[0].sampling.temperature == 0.7 and typed[0].top_logprobs[0][1] == (5, -2.5)


@pytest.mark.parametrize("read", [read_traffic, read_records])
def test_a_bad_line_in_the_middle_is_named_by_file_and_line(tmp_path, read):
    bad = line(id="b", sampling={**record()["sampling"], "temperature": -1})
    (tmp_path / shard_name(1)).write_bytes(line(id="a") + bad + line(id="c"))
    with pytest.raises(TrafficError, match=rf"{shard_name(1)}:2: sampling.temperature: -1"):
        read(tmp_path)
    (tmp_path / shard_name(1)).write_bytes(line(id="a") + b"{not json\n")
    with pytest.raises(TrafficError, match=rf"{shard_name(1)}:2: "):
        read(tmp_path)


def test_the_formats_layer_loads_no_model_library():
    """The online job's and the server's shared formats import pydantic, not torch."""
    probe = (
        "import sys\n"
        "import specdistill.formats.published, specdistill.formats.traffic_shards\n"
        "print([m for m in ('torch', 'numpy', 'transformers') if m in sys.modules])\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
