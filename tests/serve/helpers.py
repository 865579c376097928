"""Traffic inputs for the serving-side tests: a traffic record as the server writes it
(`record`), the lines a vLLM proxy log holds (`vllm_lines`), and a stand-in for the SGLang
request class a dump names (`GenerateReqInput`)."""


def record(**changes) -> dict:
    rec = {
        "schema_version": 1,
        "id": "cmpl-1",
        "time": 1764662400.25,
        "endpoint": "completions",
        "target": {"name": "t", "identity": "sha256:ab"},
        "draft_version": "v000001",
        "sampling": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 4, "seed": None, "stop": []},
        "prompt": "héllo",
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [3, 4],
        "completion_text": "wörld",
        "finish_reason": "length",
        "speculative": {
            "mean_acceptance_length": 1.5,
            "draft_acceptance_rate": 0.25,
            "acceptance_histogram": [1, 0],
            "num_spec_steps": 2,
            "num_draft_tokens": 4,
            "num_accepted_draft_tokens": 1,
        },
        "category": None,
        "top_logprobs": [[[3, -0.1], [5, -2.5]], [[4, -0.01]]],
        "latency_s": 0.5,
        "ttft_s": 0.1,
        "client": None,
    }
    rec.update(changes)
    return rec


SPEC = {
    "num_spec_steps": 4,
    "num_draft_tokens": 16,
    "num_accepted_draft_tokens": 10,
    "acceptance_histogram": [4, 3, 2, 1],
    "mean_acceptance_length": 3.5,
    "draft_acceptance_rate": 0.625,
}


def vllm_lines(tokenizer) -> list[dict]:
    text = "    return a + b\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    completion = {
        "request": {
            "model": "t",
            "prompt": "def add(a, b):\n",
            "temperature": 0.7,
            "max_tokens": 16,
            "metadata": {"category": "code"},
            "logprobs": 2,
        },
        "response": {
            "id": "cmpl-1",
            "created": 1700000000,
            "choices": [
                {
                    "text": text,
                    "finish_reason": "stop",
                    "token_ids": ids,
                    "logprobs": {"top_logprobs": [{t: -0.1} for t in tokens]},
                }
            ],
            "metrics": {"speculative_decoding": SPEC},
        },
    }
    chat = {
        "request": {"model": "t", "messages": [{"role": "user", "content": "print squares"}]},
        "response": {
            "id": "chatcmpl-2",
            "created": 1700000001,
            "choices": [
                {
                    "message": {"role": "assistant", "content": "for i in range(10):"},
                    "finish_reason": "length",
                    "logprobs": {
                        "content": [
                            {
                                "token": t,
                                "logprob": -0.5,
                                "top_logprobs": [{"token": t, "logprob": -0.5}],
                            }
                            for t in tokenizer.convert_ids_to_tokens(
                                tokenizer.encode("for i in range(10):", add_special_tokens=False)
                            )
                        ]
                    },
                }
            ],
        },
    }
    two_choices = {"request": {"prompt": "x"}, "response": {"choices": [{}, {}]}}
    return [completion, chat, two_choices]


class GenerateReqInput:  # stands for SGLang's class: the dump names a class we never import
    def __init__(self, text, sampling_params):
        self.text, self.sampling_params, self.rid = text, sampling_params, "r1"
