"""The 2026-12-01 repro of prefix caching under recompute preemption (slow: two engines
compile; the fast engine-level check is test_sharing's
test_waiting_hits_give_way_to_running_requests).

Before the fix, request 0 was finished "for capacity" after 19 of its 24 tokens: a
request preempted by recompute waited holding its re-attached prefix hit, and the
running request, short of blocks with nobody behind it to preempt, was judged unable to
fit the pool. docs/prefix_caching.md, "Waiting holds give way".
"""

from __future__ import annotations

import pytest

from pagedjax import LLM, SamplingParams

ARGS = dict(
    num_gpu_blocks_override=20, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
    warmup="none",
)  # fmt: skip


@pytest.mark.slow
def test_prefix_caching_with_recompute_preemption_equals_caching_off():
    prompts = [list(range(3, 3 + n)) for n in (22, 21, 10, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        llm = LLM("tiny-llama", enable_prefix_caching=caching, **ARGS)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[caching] = [o.outputs[0].token_ids for o in outs]
        assert llm.llm_engine.num_preemptions > 0  # the geometry forces recompute
    assert [len(t) for t in runs[True]] == [24] * 4
    assert runs[True] == runs[False]
