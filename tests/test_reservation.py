"""Orca reservation policies through the MemoryPolicy interface, against a Python model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedjax.memory.buddy import buddy_free_blocks
from pagedjax.memory.reservation import ReservationPolicy
from pagedjax.memory.static_batching import static_batch_size, static_batching_policy

MAX_SEQS, B, CAP, MML = 6, 3, 300, 64
POLICIES = [
    ReservationPolicy("max", MAX_SEQS, CAP, MML),
    ReservationPolicy("pow2", MAX_SEQS, CAP, MML),
    ReservationPolicy("oracle", MAX_SEQS, CAP, MML, watermark_frac=0.1),
    ReservationPolicy("pow2", MAX_SEQS, CAP - 1, 48, watermark_frac=0.05, min_block=4),
]
# Jitted once at module level with fixed sizes ([B] batches, [MAX_SEQS] usage).
JIT = {p: (jax.jit(p.grow), jax.jit(p.release), jax.jit(p.usage)) for p in POLICIES}


def pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def model_reservation(p: ReservationPolicy, prompt: int, final: int) -> int:
    if p.kind == "max":
        return p.max_model_len
    if p.kind == "oracle":
        return final
    return min(prompt + pow2(max(final - prompt, 0)), p.max_model_len)


def chunk_of(p: ReservationPolicy, r: int) -> int:
    return p.min_block * pow2(-(-r // p.min_block))


class ReservationMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(POLICIES))
    def setup(self, policy):
        self.p = policy
        self.grow, self.release, self.usage = JIT[policy]
        self.state = policy.init_state()
        self.lens = [0] * MAX_SEQS
        self.final = [0] * MAX_SEQS
        self.r = [0] * MAX_SEQS  # 0: holds nothing

    @rule(data=st.data())
    def grow_batch(self, data):
        p, mml = self.p, self.p.max_model_len
        free_blocks = buddy_free_blocks(self.state.buddy)
        free = int(self.state.buddy.free_slots)
        rows, want = [], []
        for _ in range(B):
            sid = data.draw(st.integers(0, MAX_SEQS - 1))
            mask = data.draw(st.booleans())
            wm = data.draw(st.booleans())
            if self.r[sid]:  # decode / later chunk: may overrun R
                new = self.lens[sid] + data.draw(st.integers(0, 3))
                final = self.final[sid]
            else:  # first grow: the prompt; the final length may exceed max_model_len
                new = data.draw(st.integers(1, mml + 2))
                final = new + data.draw(st.integers(0, mml))
            rows.append((sid, new, final, mask, wm))
            if not mask:
                want.append(True)
                continue
            if self.r[sid]:
                ok = new <= self.r[sid]
            else:
                r = model_reservation(p, new, final)
                c = chunk_of(p, r)
                room = free - c >= (p.watermark_slots if wm else 0)
                ok = new <= r and room and any(size >= c for _, size in free_blocks)
                if ok:  # the chunk comes out of the smallest free block that fits
                    i = min(
                        (k for k, (_, s) in enumerate(free_blocks) if s >= c),
                        key=lambda k: (free_blocks[k][1], free_blocks[k][0]),
                    )
                    off, size = free_blocks.pop(i)
                    while size > c:
                        size //= 2
                        free_blocks.append((off + size, size))
                    free -= c
                    self.r[sid], self.final[sid] = r, final
            if ok:
                self.lens[sid] = new
            want.append(ok)
        ids, news, finals, masks, wms = (np.array(c) for c in zip(*rows, strict=True))
        self.state, ok = self.grow(
            self.state,
            jnp.asarray(ids, jnp.int32),
            jnp.asarray(news, jnp.int32),
            jnp.asarray(finals, jnp.int32),
            jnp.full(B, mml, jnp.int32),
            jnp.asarray(masks),
            jnp.asarray(wms),
        )
        assert np.asarray(ok).tolist() == want, (rows, want)

    @precondition(lambda self: any(self.r))
    @rule(data=st.data())
    def release_some(self, data):
        ids = [data.draw(st.integers(0, MAX_SEQS - 1)) for _ in range(B)]
        mask = [data.draw(st.booleans()) for _ in range(B)]
        self.state = self.release(self.state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))
        for sid, m in zip(ids, mask, strict=True):
            if m:
                self.r[sid] = self.lens[sid] = self.final[sid] = 0

    @invariant()
    def accounting(self):
        if not hasattr(self, "p"):
            return
        held = [r > 0 for r in self.r]
        assert np.asarray(self.state.held).tolist() == held
        u = self.usage(
            self.state,
            jnp.asarray(self.lens, jnp.int32),
            jnp.asarray(self.final, jnp.int32),
            jnp.asarray(held),
        )
        vals = [float(x) for x in u]
        assert all(v >= 0 for v in vals), vals
        assert vals[0] + vals[1] + vals[2] + vals[3] == vals[4] == self.p.capacity_tokens
        live = [i for i in range(MAX_SEQS) if held[i]]
        assert vals[0] == sum(self.lens[i] for i in live)
        # Final lengths may pass R (Max, Pow2 caps) and lengths may pass final: clip.
        assert vals[1] == sum(max(min(self.final[i], self.r[i]) - self.lens[i], 0) for i in live)
        assert vals[2] == sum(max(self.r[i] - max(self.final[i], self.lens[i]), 0) for i in live)
        # External + free holds the buddy slack pow2(R) - R on top of the free blocks.
        chunks = [chunk_of(self.p, self.r[i]) for i in live]
        slack = sum(c - self.r[i] for c, i in zip(chunks, live, strict=True))
        free = int(self.state.buddy.free_slots)
        tail = self.p.capacity_tokens % self.p.min_block
        assert vals[3] == free + slack + tail
        offsets = np.asarray(self.state.offset)
        spans = sorted((int(offsets[i]), c) for i, c in zip(live, chunks, strict=True))
        for (o1, c1), (o2, _) in zip(spans, spans[1:], strict=False):
            assert o1 % c1 == 0 and o1 + c1 <= o2, "chunks overlap or are misaligned"
        if spans:
            assert spans[-1][0] + spans[-1][1] <= self.p.capacity_tokens


TestReservationMachine = ReservationMachine.TestCase
TestReservationMachine.settings = settings(settings.default, stateful_step_count=10)


def _grow(p, state, ids, new, final, watermark=False):
    n = len(ids)
    return p.grow(
        state,
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(new, jnp.int32),
        jnp.asarray(final, jnp.int32),
        jnp.full(n, p.max_model_len, jnp.int32),
        jnp.ones(n, bool),
        jnp.full(n, watermark),
    )


def test_opt13b_orca_max_batches_seven_and_leaves_8_85_percent():
    capacity = (12 * 2**30) // 819200  # 12 GiB of KV at 800 KiB per token (OPT-13B)
    assert capacity == 15728
    p = static_batching_policy(8, capacity, 2048)
    assert static_batch_size(capacity, 2048) == 7
    state, ok = _grow(p, p.init_state(), range(8), [100] * 8, [400] * 8)
    assert np.asarray(ok).tolist() == [True] * 7 + [False]
    lens = jnp.asarray([100] * 7 + [0], jnp.int32)
    live = jnp.asarray([True] * 7 + [False])
    u = p.usage(state, lens, jnp.full(8, 400, jnp.int32), live)
    assert float(u.external_free_slots) == 15728 - 7 * 2048
    assert round(100 * float(u.external_free_slots / u.total_slots), 2) == 8.85
    assert float(u.token_slots) == 700 and float(u.reserved_slots) == 7 * 300
    assert float(u.internal_frag_slots) == 7 * (2048 - 400)


@pytest.mark.parametrize("mml, prompt, final, never_used", [(2048, 7, 10, 2038), (512, 3, 5, 507)])
def test_fig3_never_used_slots(mml, prompt, final, never_used):
    """Fig. 3: current token written at prompt + 1, two (one) reserved, the rest unused."""
    p = ReservationPolicy("max", 1, 4096, mml)
    state, ok = _grow(p, p.init_state(), [0], [prompt], [final])
    state, ok2 = _grow(p, state, [0], [prompt + 1], [final])
    assert bool(ok[0]) and bool(ok2[0])
    u = p.usage(state, jnp.asarray([prompt + 1]), jnp.asarray([final]), jnp.asarray([True]))
    assert float(u.internal_frag_slots) == never_used
    assert float(u.reserved_slots) == final - prompt - 1


def test_pow2_and_buddy_rounding():
    p = ReservationPolicy("pow2", 2, 8192, 2048)
    state, ok = _grow(p, p.init_state(), [0, 1], [10, 1024], [35, 1100])
    # Output 25 -> 32; prompt 1024 + output 76 -> 1024 + 128, a 2048-slot chunk (Fig. 17).
    assert np.asarray(state.reserved_len).tolist() == [10 + 32, 1024 + 128]
    # Chunks are pow2(R): 64 and 2048 slots.
    assert int(state.buddy.free_slots) == 8192 - 64 - 2048
    state = p.release(state, jnp.asarray([0, 1], jnp.int32), jnp.ones(2, bool))
    assert buddy_free_blocks(state.buddy) == [(0, 8192)]


def test_watermark_and_growth_limit():
    p = ReservationPolicy("max", 5, 64, 16, watermark_frac=0.25)  # watermark 16 slots
    state, ok = _grow(p, p.init_state(), range(4), [4] * 4, [8] * 4, watermark=True)
    assert np.asarray(ok).tolist() == [True, True, True, False]
    state, ok = _grow(p, state, [3, 0, 1], [4, 16, 17], [8, 8, 8])
    assert np.asarray(ok).tolist() == [True, True, False]  # no watermark; 17 > R = 16


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(kind="min"), "kind"),
        (dict(max_seqs=0), "max_seqs"),
        (dict(capacity_tokens=-1), "capacity_tokens"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(watermark_frac=1.0), "watermark_frac"),
        (dict(min_block=0), "min_block"),
    ],
)
def test_rejects_bad_config(kwargs, name):
    cfg = dict(kind="max", max_seqs=2, capacity_tokens=64, max_model_len=16) | kwargs
    with pytest.raises(ValueError, match=name):
        ReservationPolicy(**cfg)


def test_static_batch_size_rounds_chunks_up():
    assert static_batch_size(15728, 2000) == 7  # 2048-slot chunks
    assert static_batch_size(15728, 2049) == 3  # 4096-slot chunks: 8192 + 4096 blocks
    with pytest.raises(ValueError, match="max_model_len"):
        static_batch_size(100, 0)
