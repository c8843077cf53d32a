"""The radix-tree prefix hint (memory/radix_hint.py) against the hash hint and a brute-force
reference, and in the engine (CacheConfig.prefix_index="radix").

Where the two hints legitimately differ (radix_hint's docstring): the radix tree is
prefix-closed, so it drops what the hash dict leaves dangling (blocks below a forgotten
or re-hinted one). So on any sequence of calls the radix proposal is a prefix of the
hash proposal (same blocks), and equals a brute-force prefix -> block dict with the
pruning rules; on lookup-then-record workloads (what the engine does) both are equal.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from pagedjax.engine.block_hashes import extend_hashes
from pagedjax.memory.prefix_cache import PrefixIndex
from pagedjax.memory.radix_hint import RadixHint, prefix_hint

B = 2  # block size of the host-side tests: short token tuples collide often
SALTS = (None, b"adapter-1")


def _hashes(tokens: list[int], salt: bytes | None) -> list[int]:
    out: list[int] = []
    extend_hashes(out, tokens, B, len(tokens) // B, salt)
    return out


class _Reference:
    """Brute force: a dict (salt, block tuples of the prefix) -> block, with the radix
    hint's rules spelled out over whole prefixes."""

    def __init__(self) -> None:
        self.d: dict[tuple, int] = {}

    @staticmethod
    def key(tokens: list[int], salt: bytes | None, n: int) -> tuple:
        return (salt, *(tuple(tokens[i * B : (i + 1) * B]) for i in range(n)))

    def _drop(self, k: tuple) -> None:  # k and every longer prefix starting with it
        for x in [x for x in self.d if x[: len(k)] == k]:
            del self.d[x]

    def propose(self, tokens: list[int], salt: bytes | None) -> list[int]:
        out = []
        for n in range(1, len(tokens) // B + 1):
            blk = self.d.get(self.key(tokens, salt, n))
            if blk is None:
                break
            out.append(blk)
        return out

    def _unhint(self, blocks) -> None:  # refilled blocks past a break lose their hints
        for blk in blocks:
            for k in [x for x, v in self.d.items() if v == blk]:
                if k in self.d:
                    self._drop(k)

    def record(self, tokens, salt, start, blocks) -> None:
        if start > 0 and self.key(tokens, salt, start) not in self.d:
            return self._unhint(blocks)
        for i, blk in enumerate(blocks, start):
            k = self.key(tokens, salt, i + 1)
            if blk == 0 or len(k[-1]) < B:
                return self._unhint(blocks[i - start :])
            if self.d.get(k) == blk:
                continue
            old = [x for x, v in self.d.items() if v == blk]
            if old:
                self._drop(old[0])
                if i > 0 and k[:-1] not in self.d:
                    return self._unhint(blocks[i - start :])
            if k in self.d:
                self._drop(k)
            self.d[k] = blk

    def forget(self, tokens, salt, start) -> None:
        k = self.key(tokens, salt, start + 1)
        if k in self.d:
            self._drop(k)


_seq = st.lists(st.integers(0, 1), min_size=0, max_size=9)
_op = st.one_of(
    st.tuples(st.just("record"), st.integers(0, 3), st.integers(0, 1), st.integers(0, 4),
              st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4), st.booleans())),

    st.tuples(st.just("forget"), st.integers(0, 3), st.integers(0, 1), st.integers(0, 4),
              st.integers(1, 3)),  # fmt: skip
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_seq, min_size=4, max_size=4), st.lists(_op, max_size=25))
def test_radix_hint_is_the_pruned_hash_hint(seqs, ops):
    """Random record / forget calls (block ids reused, null blocks, chains broken, two
    salts): after each, for every sequence and salt the radix proposal equals the
    reference's and is a prefix of the hash hint's."""
    hint, radix, ref = PrefixIndex(), RadixHint(B), _Reference()
    for kind, s, salt_i, start, arg in ops:
        toks, salt = seqs[s], SALTS[salt_i]
        hs = _hashes(toks, salt)
        if kind == "record":
            n = len(hs) - start
            if n <= 0:
                continue
            blocks, by_hash = arg[0][:n], arg[1]  # by_hash: the parent found by its hash
            hint.record(hs[start : start + len(blocks)], blocks)
            radix.record(hs[start : start + len(blocks)], blocks, tokens=toks, start=start,
                         salt=salt, parent_hash=hs[start - 1] if by_hash and start else None)
            ref.record(toks, salt, start, blocks)
        else:
            if start >= len(hs):
                continue
            hint.forget(hs[start : start + arg])
            radix.forget(hs[start : start + arg], tokens=toks, start=start, salt=salt)
            ref.forget(toks, salt, start)
        for t in seqs:
            for salt in SALTS:
                hs = _hashes(t, salt)
                got = radix.propose(hs, tokens=t, salt=salt)
                assert got == ref.propose(t, salt)
                assert got == hint.propose(hs)[: len(got)]
    assert len(radix) == len(ref.d)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_seq, st.integers(0, 1), st.integers(1, 3)), max_size=15))
def test_lookup_then_record_gives_equal_proposals(work):
    """The engine's pattern: look the sequence up, then record its remaining full blocks
    in fresh blocks, a chunk at a time. Both hints propose exactly the same blocks."""
    hint, radix = PrefixIndex(), RadixHint(B)
    fresh = iter(range(1, 10_000))
    for toks, salt_i, chunk in work:
        salt = SALTS[salt_i]
        hs = _hashes(toks, salt)
        got = radix.propose(hs, tokens=toks, salt=salt)
        assert got == hint.propose(hs)
        lo = len(got)
        while lo < len(hs):
            hi = min(len(hs), lo + chunk)
            blocks = [next(fresh) for _ in range(lo, hi)]
            hint.record(hs[lo:hi], blocks)
            radix.record(hs[lo:hi], blocks, tokens=toks, start=lo, salt=salt,
                         parent_hash=hs[lo - 1] if lo else None)  # fmt: skip
            lo = hi
        assert radix.propose(hs, tokens=toks, salt=salt) == hint.propose(hs)
        assert len(radix.propose(hs, tokens=toks, salt=salt)) == len(hs)


def test_salts_never_share_and_forget_prunes_the_subtree():
    radix = RadixHint(B)
    t = [1, 2, 3, 4, 5, 6]
    radix.record([0, 0, 0], [7, 8, 9], tokens=t, salt=None)
    assert radix.propose([0, 0, 0], tokens=t, salt=b"x") == []
    assert radix.propose([0, 0, 0], tokens=t) == [7, 8, 9]
    radix.record([0], [5], tokens=[1, 2, 9, 9], start=1)  # a branch below block 7
    radix.forget([0], tokens=t, start=0)  # block 7 failed on device: 8, 9, 5 hang below
    assert len(radix) == 0 and radix.propose([0, 0], tokens=[1, 2, 9, 9]) == []


def test_prefix_index_option_is_checked():
    assert CacheConfig().prefix_index == "hash"
    assert CacheConfig(prefix_index="radix").prefix_index == "radix"
    with pytest.raises(ConfigError, match="cache.prefix_index.*'hash' or 'radix'"):
        CacheConfig(prefix_index="trie")  # type: ignore[arg-type]
    # with the host tier since it asks the radix hint's hash maps (kv_offload.plan)
    assert CacheConfig(prefix_index="radix", kv_offloading_size=0.5).kv_offloading_size == 0.5
    assert isinstance(prefix_hint("radix", 4), RadixHint)
    assert isinstance(prefix_hint("hash", 4), PrefixIndex)
    with pytest.raises(ValueError, match="'trie'"):
        prefix_hint("trie", 4)


def test_prefix_index_reaches_the_config_from_llm_and_the_server_flag():
    """``LLM(prefix_index=...)`` and ``--prefix-index`` set CacheConfig.prefix_index; a
    value the flag does not know exits with argparse's usage error (status 2)."""
    from pagedjax.entrypoints.llm import engine_config
    from pagedjax.entrypoints.openai import cli_args

    assert engine_config(model="tiny-llama").cache.prefix_index == "hash"
    assert engine_config(model="tiny-llama", prefix_index="radix").cache.prefix_index == "radix"
    parser = cli_args.make_parser()
    kwargs = cli_args.llm_kwargs(parser.parse_args(["--model", "m", "--prefix-index", "radix"]))
    assert kwargs["prefix_index"] == "radix"
    assert "prefix_index" not in cli_args.llm_kwargs(parser.parse_args(["--model", "m"]))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--model", "m", "--prefix-index", "trie"])
    assert exit_info.value.code == 2


# -- the engine: tests/test_sharing.py's geometry (block 4, max_len 64, 4 seqs, budget 16,
#    24 blocks) built with prefix_index="radix".


@pytest.mark.tier2
def test_engine_radix_and_hash_hints_give_equal_outputs_and_hits():
    """A workload with prefix hits (prompts sharing prefixes, arriving over time), chunked
    prefill (prompts longer than the budget) and preemption (four 40-token sequences
    in 23 blocks): greedy outputs and hit counters are the same with either hint."""
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.sampling import SamplingParams
    from pagedjax.tokenizer import ByteTokenizer
    from tests.engine_helpers import drain
    from tests.test_engine import ARCH, _params

    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=64, seed=0),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=24, enable_prefix_caching=True,
                          prefix_index="radix"),  # fmt: skip
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, watermark=0.0),
    )
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    engine = LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))
    assert isinstance(engine.core.prefix_index, RadixHint)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, ARCH.vocab_size, 17).tolist()
    other = rng.integers(3, ARCH.vocab_size, 9).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
    arrivals: dict[int, list] = {}
    for i in range(10):
        head = shared if i % 3 else other
        prompt = head + rng.integers(3, ARCH.vocab_size, int(rng.integers(2, 20))).tolist()
        arrivals.setdefault(3 * i, []).append((f"r{i}", prompt, params))

    def run(hint):
        engine.core.prefix_index = hint
        engine.reset_stats()
        done = drain(engine, arrivals)
        return {k: v.outputs[0].token_ids for k, v in done.items()}, engine.stats()

    out_h, st_h = run(PrefixIndex())
    out_r, st_r = run(RadixHint(4))
    assert out_r == out_h
    for key in ("prefix_cache_hit_tokens", "prefix_cache_query_tokens", "prefix_cache_queries"):
        assert st_r[key] == st_h[key], key
    assert st_h["prefix_cache_hit_tokens"] > 0
    assert engine.num_preemptions > 0


@pytest.mark.tier2
def test_blocks_filled_inside_a_k_step_loop_are_hinted():
    """The K-step decoder records the blocks its loop filled one by one
    (``output_processor.record_filled``): with the radix hint, a prompt that is an
    earlier request's prompt + output hits all its full blocks, as with the hash hint
    (tests/test_multi_step.py's engine and check)."""
    from tests.test_multi_step import BLOCK, _assert_idle, _drain, _engine, _greedy, _prompt

    engine = _engine(True)
    saved, engine.core.prefix_index = engine.core.prefix_index, RadixHint(BLOCK)
    try:
        prompt = _prompt(np.random.default_rng(5), 5)  # 1 full block after prefill
        first = _drain(engine, {0: [("a", prompt, _greedy(16))]})["a"].outputs[0].token_ids
        assert engine.multi_step.stats.iterations >= 8  # most of its decode ran in loops
        hits0 = engine.stats()["prefix_cache_hit_tokens"]
        _drain(engine, {0: [("b", prompt + first[:14], _greedy(2))]})  # 4 full blocks
        assert engine.stats()["prefix_cache_hit_tokens"] - hits0 == 4 * BLOCK
        _assert_idle(engine)
    finally:
        engine.core.prefix_index = saved
