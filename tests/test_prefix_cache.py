"""Prefix caching at the memory level: chained hashes, device verification, revival,
eviction in LRU order, and that a hit never returns a block holding other tokens."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from pagedjax.memory import prefix_cache as pc
from pagedjax.memory.paged_policy import PagedPolicy

BS, NB, SEQS, MAXB = 4, 16, 3, 6
POLICY = PagedPolicy(NB, BS, SEQS, MAXB, enable_prefix_caching=True)
grow = jax.jit(POLICY.grow)
release = jax.jit(POLICY.release)
register = jax.jit(pc.register)
match = jax.jit(pc.match)
acquire = jax.jit(pc.acquire)


def blocks_tokens(tokens: list[int], k: int) -> np.ndarray:
    out = np.full((MAXB, BS), -1, np.int32)
    for i in range(k):
        out[i] = tokens[i * BS : (i + 1) * BS]
    return out


class Cache:
    """Drives PagedPolicy + prefix cache the way the engine does."""

    def __init__(self):
        self.state = POLICY.init_state()
        self.index = pc.PrefixIndex()

    def run(self, seq: int, tokens: list[int]) -> int:
        """Admit ``tokens`` into slot ``seq`` reusing the cache; returns the hit in blocks."""
        hashes = pc.chain_hashes(tokens, BS)
        proposed = self.index.propose(hashes)
        k = len(proposed)
        cand = np.zeros(MAXB, np.int32)
        cand[:k] = proposed
        hit = int(match(self.state.prefix, jnp.asarray(cand), blocks_tokens(tokens, k), k))
        if hit < k:
            self.index.forget(hashes[hit:k])
        use = pc.usable_hit(hit, len(tokens), BS)
        # Attach the hit: acquire, write the row, then grow for the rest.
        pool = acquire(self.state.pool, jnp.asarray(cand), use)
        tables = self.state.tables
        row = tables.tables[seq].at[:use].set(jnp.asarray(cand[:use]))
        tables = tables._replace(
            tables=tables.tables.at[seq].set(row), lengths=tables.lengths.at[seq].set(use * BS)
        )
        self.state = self.state._replace(pool=pool, tables=tables)
        one = jnp.ones(1, bool)
        n = jnp.asarray([len(tokens)], jnp.int32)
        self.state, ok = grow(self.state, jnp.asarray([seq]), n, n, n, one, ~one)
        assert bool(ok[0])
        # The KV of the full blocks is now written: register them.
        full = len(tokens) // BS
        table = np.asarray(self.state.tables.tables[seq])
        parents = np.concatenate([[0], table[: MAXB - 1]]).astype(np.int32)
        mask = np.arange(MAXB) < full
        self.state = self.state._replace(
            prefix=register(
                self.state.prefix,
                jnp.asarray(table),
                jnp.asarray(parents),
                jnp.asarray(blocks_tokens(tokens, full)),
                jnp.asarray(mask),
            )
        )
        self.index.record(hashes, list(table[:full]))
        return use

    def release(self, seq: int) -> None:
        self.state = release(self.state, jnp.asarray([seq]), jnp.ones(1, bool))


def test_chain_hashes_follow_prefixes():
    a = list(range(20))
    b = a[:9] + [99] + a[10:]
    ha, hb = pc.chain_hashes(a, BS), pc.chain_hashes(b, BS)
    assert len(ha) == 5
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))


def test_hit_revive_and_whole_prompt_drops_last_block():
    c = Cache()
    prompt = list(range(1, 13))  # 3 full blocks
    assert c.run(0, prompt) == 0
    first_blocks = list(np.asarray(c.state.tables.tables[0, :3]))
    c.release(0)  # blocks freed but still cached
    assert int(c.state.pool.num_free) == NB - 1
    # Same prompt again: fully cached at a block boundary -> reuse 2 blocks, not 3.
    assert c.run(1, prompt) == 2
    assert list(np.asarray(c.state.tables.tables[1, :2])) == first_blocks[:2]
    # A longer prompt with the same start reuses all 3 cached blocks of the shared prefix.
    # (Its third block is the one seq 1 wrote, the most recent registration of that hash.)
    assert c.run(2, prompt + [50, 51]) == 3
    second_third = int(c.state.tables.tables[1, 2])
    assert int(c.state.tables.tables[2, 2]) == second_third
    rc = np.asarray(c.state.pool.refcount)
    assert rc[first_blocks[0]] == 2 and rc[first_blocks[1]] == 2 and rc[second_third] == 2
    assert rc[first_blocks[2]] == 0  # freed, still cached, still in the free list


def test_eviction_invalidates_and_stale_hints_are_rejected():
    c = Cache()
    prompt = list(range(1, 13))
    c.run(0, prompt)
    old_blocks = [int(x) for x in np.asarray(c.state.tables.tables[0, :3])]
    c.release(0)  # free list: never-used blocks first, then the 3 cached ones (LRU)
    c.run(1, [70 + i for i in range(24)])
    c.run(2, [200 + i for i in range(24)])  # the never-used blocks are gone now
    c.release(2)
    c.run(2, [300 + i for i in range(24)])  # so this reuses the cached blocks first
    hashes = pc.chain_hashes(prompt, BS)
    # Registering the reused blocks dropped their earlier content's hints (one hash per
    # block: a refill with equal tokens under another cache salt must not verify) ...
    assert c.index.propose(hashes) == []
    c.index.record(hashes, old_blocks)  # ... so put the stale hint back by hand:
    assert len(c.index.propose(hashes)) == 3  # the host hint is stale ...
    assert c.run(0, prompt) == 0  # ... and rejected on device
    # That admission registered fresh blocks, so the next one hits again.
    c.release(0)
    assert c.run(0, prompt) == 2


def test_forged_hint_with_wrong_tokens_is_rejected():
    c = Cache()
    c.run(0, list(range(1, 9)))
    first = list(np.asarray(c.state.tables.tables[0, :2]))
    c.release(0)
    other = [5, 5, 5, 5, 6, 6, 6, 6]
    # A colliding hint: the other prompt's hashes point at the first prompt's blocks.
    c.index.record(pc.chain_hashes(other, BS), first)
    blocks = c.index.propose(pc.chain_hashes(other, BS))
    assert len(blocks) == 2
    cand = np.zeros(MAXB, np.int32)
    cand[:2] = blocks
    assert int(match(c.state.prefix, jnp.asarray(cand), blocks_tokens(other, 2), 2)) == 0


@settings(max_examples=30)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, SEQS - 1), st.integers(0, 3), st.integers(1, 20)),
        min_size=1,
        max_size=12,
    )
)
def test_hits_only_return_matching_tokens(ops):
    """Random admissions of prompts sharing prefixes: any reused block holds exactly the
    prompt's tokens (checked against a ground-truth record of what each block holds)."""
    c = Cache()
    holds: dict[int, tuple[int, ...]] = {}  # block -> tokens written into it (full blocks)
    live = set()
    for seq, family, length in ops:
        if seq in live:
            c.release(seq)
            live.discard(seq)
        base = [family * 100 + i for i in range(24)]
        prompt = base[:length]
        used = c.run(seq, prompt)
        live.add(seq)
        table = np.asarray(c.state.tables.tables[seq])
        for i in range(used):
            assert holds[int(table[i])] == tuple(prompt[i * BS : (i + 1) * BS])
        for i in range(len(prompt) // BS):
            holds[int(table[i])] = tuple(prompt[i * BS : (i + 1) * BS])
        # Partial last blocks get new contents: forget what they held.
        if len(prompt) % BS:
            holds.pop(int(table[len(prompt) // BS]), None)
    for seq in live:
        c.release(seq)
    assert int(c.state.pool.num_free) == NB - 1
