"""The traffic record's one schema: what the writer writes is what the readers accept."""

import json
import re

import pytest

from specdistill.formats.traffic import TrafficError, TrafficRecord, validate
from specdistill.formats.traffic_shards import read_traffic
from specdistill.serve.traffic import TrafficLog
from tests.serve.helpers import record


def test_the_model_writes_the_lines_the_dict_writer_wrote(tmp_path):
    rec = record()
    expected = json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n"
    assert TrafficRecord.model_validate(rec).line() == expected.encode()
    log = TrafficLog(tmp_path)
    log.append(TrafficRecord.model_validate(rec))
    log.append(record(id="cmpl-2", unknown_field=[1]))  # unknown fields are kept, not required
    log.close()
    assert (tmp_path / "traffic-000001.jsonl").read_text().splitlines()[0] == expected.strip()
    assert [r["id"] for r in read_traffic(tmp_path)] == ["cmpl-1", "cmpl-2"]
    no_client = record()
    del no_client["client"]
    assert b'"client"' not in TrafficRecord.model_validate(no_client).line()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"time": "yesterday"}, "time: is not a number (got 'yesterday')"),
        ({"sampling": {**record()["sampling"], "temperature": -1}}, "sampling.temperature: -1"),
        (
            {"sampling": {**record()["sampling"], "top_p": 0.0}},
            "sampling.top_p: 0.0 is not in (0, 1]",
        ),
        ({"completion_token_ids": [3, True]}, "completion_token_ids.1"),
        ({"top_logprobs": [[[3, -0.1]]]}, "top_logprobs has 1 entries for 2 completion tokens"),
        ({"top_logprobs": [[[3, -0.1], [3, -0.2]], [[4, -0.1]]]}, "repeats a token id"),
        ({"top_logprobs": [[[3, 2.0]], [[4, -0.1]]]}, "2.0 is not in (-inf, 0.0001]"),
        ({"client": "someone"}, "client"),
        ({"schema_version": 2}, "schema_version 2 is not 1"),
        ({"sampling": {**record()["sampling"], "max_tokens": -1}}, "sampling.max_tokens"),
        (
            {"speculative": {**record()["speculative"], "acceptance_histogram": [-1]}},
            "speculative.acceptance_histogram.0",
        ),
        ({"endpoint": "evil"}, "endpoint: Input should be 'completions' or 'chat.completions'"),
        ({"finish_reason": "evil"}, "finish_reason: Input should be 'stop'"),
        ({"time": -1}, "time: -1 is not in [0, inf)"),
        ({"latency_s": -1}, "latency_s: -1 is not in [0, inf)"),
        ({"ttft_s": -0.5}, "ttft_s: -0.5 is not in [0, inf)"),
    ],
)
def test_a_record_outside_the_schema_is_refused_naming_field_and_value(changes, message):
    with pytest.raises(TrafficError, match=re.escape(message)):
        validate(record(**changes))


def test_a_missing_field_is_named():
    rec = record()
    del rec["speculative"]["num_spec_steps"]
    with pytest.raises(TrafficError, match="'speculative.num_spec_steps' missing"):
        validate(rec)
