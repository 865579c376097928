"""A Prometheus page as vLLM 0.32 writes it, with the speculation counters the served-acceptance
tests set (tests/eval/test_served_metrics.py, tests/online_demo/test_vllm_loop_parts.py)."""

PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.79e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {tokens}
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="2"}} {p2}
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {generated}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 3.0
"""


def page(drafts, accepted_per_position, generated):
    p0, p1, p2 = accepted_per_position
    return PAGE.format(
        drafts=float(drafts),
        tokens=float(3 * drafts),
        accepted=float(p0 + p1 + p2),
        p0=p0,
        p1=p1,
        p2=p2,
        generated=float(generated),
    )
