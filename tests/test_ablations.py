"""Issue 34's ablations as named systems (no simulation: policies and settings only)."""

import pytest

from pagedjax.simulator import systems


def test_vattention_pages_are_contiguous_kernel_pools_of_page_sized_blocks():
    # OPT-13B: one layer's K is 40 heads x 128 x 2 B = 10 KiB per token.
    assert systems.page_tokens(64 << 10, "opt-13b") == 4  # 6.4 -> 4 (power of two)
    assert systems.page_tokens(2 << 20, "opt-13b") == 128  # 204.8 -> 128
    assert systems.page_tokens(2 << 20, "llama-2-7b") == 256  # 8 KiB per token: exact
    policy, _ = systems.build_system("vattention_2m", kv_slots=15728)
    assert isinstance(policy, systems.VirtualContiguousPolicy) and policy.contiguous_kernel
    assert policy.block_size == 128 and policy.num_blocks == 15728 // 128 + 1
    paged, _ = systems.build_system("paged", kv_slots=15728)
    assert not getattr(paged, "contiguous_kernel", False)


def test_fp8_ablation_changes_the_server_not_the_policy():
    assert systems.SYSTEM_SERVER["paged_fp8"] == {"kv_cache_dtype": "fp8"}
    fp8, _ = systems.build_system("paged_fp8", kv_slots=2 * 15728)
    assert fp8.num_blocks == 2 * 15728 // 16 + 1
    with pytest.raises(ValueError, match="vattention_64k"):
        systems.build_system("vattention")
