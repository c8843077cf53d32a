"""Logits and greedy parity of pagedjax models against transformers (PyTorch CPU).

Every family runs one-shot prefill, chunked prefill (random chunk sizes, mixed with other
sequences' decode tokens in one ragged batch) and 20 decode steps over a NaN-filled paged
cache with randomly permuted pages; logits at every token are compared with one HF forward
over the whole sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import NEW_FAMILIES, PagedRunner, hf_logits, save_tiny_hf_model

from pagedjax.model import load_hf_checkpoint

torch = pytest.importorskip("torch")
# The models are tiny: torch's intra-op threads only add synchronization, and on a loaded
# 2-core box they thrash (3 HF generates of 32 tokens: 20 s with the default, 1 s with 1).
torch.set_num_threads(1)

FP32_ATOL = 1e-4
# The families of issue 23 are held to the bound (measured 2e-6 .. 6e-6).
FP32_ATOL_BY_FAMILY = {f: 1e-5 for f in NEW_FAMILIES}
# bf16 weights, activations and cache against the fp32 HF model: bf16 keeps 8 mantissa bits,
# so each matmul/residual rounds at ~4e-3 relative; through 2 layers logits of magnitude ~5
# drift by about 0.1. Measured 0.159 (llama3) and 0.094 (qwen2); the bound leaves ~2x.
BF16_ATOL = 0.3
BLOCK_SIZES = {"llama": 1, "llama3": 16, "mistral": 32, "qwen2": 16, "opt": 1, "opt_post_ln": 32,
               "gpt_neox": 16, "gemma2": 4, "qwen3": 1, "phi3": 8, "mixtral": 16}  # fmt: skip
MAX_TOKENS, MAX_SEQS, MAX_LEN = 32, 4, 64
NUM_DECODE = 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (hf model, arch, fp32 params), built once per module."""
    cache = {}

    def get(family):
        if family not in cache:
            d = tmp_path_factory.mktemp(family)
            model = save_tiny_hf_model(family, d, seed=1)
            cache[family] = (model, d, *load_hf_checkpoint(d))
        return cache[family]

    return get


def _runner(arch, params, family, seed, dtype=None, attention_fn=None):
    kwargs = {} if dtype is None else {"dtype": dtype}
    if attention_fn is not None:
        kwargs["attention_fn"] = attention_fn
    return PagedRunner(arch, params, block_size=BLOCK_SIZES[family], max_tokens=MAX_TOKENS,
                       max_seqs=MAX_SEQS, max_len=MAX_LEN, seed=seed, **kwargs)  # fmt: skip


def _chunks(rng, n, max_chunk):
    out, i = [], 0
    while i < n:
        c = int(rng.integers(1, max_chunk + 1))
        out.append((i, min(n, i + c)))
        i += c
    return out


def run_mixed_schedule(runner, seqs, rng):
    """Seq 0: one-shot prefill; seqs 1..: chunked prefill. Every prompt token of a sequence
    is followed by teacher-forced decode tokens (one per step) once its prompt is in.
    Returns {seq: logits [len(tokens), vocab]}."""
    prompts = {s: n for s, (_, n) in enumerate(seqs)}
    plans = {0: [(0, prompts[0])]}
    for s in range(1, len(seqs)):
        plans[s] = _chunks(rng, prompts[s], 8)
    cursor = {s: 0 for s in range(len(seqs))}  # tokens sent so far
    got = {s: [] for s in range(len(seqs))}
    while any(cursor[s] < len(seqs[s][0]) for s in cursor):
        work = []
        for s, (tokens, _) in enumerate(seqs):
            if cursor[s] >= len(tokens):
                continue
            if plans[s]:
                lo, hi = plans[s].pop(0)
            else:
                lo, hi = cursor[s], cursor[s] + 1  # decode
            work.append((s, tokens[lo:hi]))
            cursor[s] = hi
        for s, logits in runner.step(work, all_logits=True).items():
            got[s].append(logits)
    return {s: np.concatenate(v) for s, v in got.items()}


def _sequences(rng, vocab):
    """(tokens, prompt_len) x 3: prompts of 5..12 (one-shot) and 9..24 (chunked)."""
    lens = [int(rng.integers(5, 13)), int(rng.integers(9, 25)), int(rng.integers(9, 25))]
    return [(list(map(int, rng.integers(3, vocab, n + NUM_DECODE))), n) for n in lens]


def logits_max_diff(family, checkpoints, dtype=None, attention_fn=None):
    model, _, arch, params = checkpoints(family)
    if dtype is not None:
        import jax

        params = jax.tree.map(lambda x: x.astype(dtype), params)
    rng = np.random.default_rng(sum(map(ord, family)))
    seqs = _sequences(rng, arch.vocab_size)
    got = run_mixed_schedule(_runner(arch, params, family, 0, dtype, attention_fn), seqs, rng)
    diffs = []
    for s, (tokens, _) in enumerate(seqs):
        ours = got[s]
        assert ours.shape == (len(tokens), arch.vocab_size)
        assert np.isfinite(ours).all(), f"NaN/inf logits for seq {s}: the NaN pool leaked"
        diffs.append(np.abs(ours - hf_logits(model, tokens)).max())
    return max(diffs)


@pytest.mark.parametrize("family", list(BLOCK_SIZES))
def test_logits_match_transformers_fp32(family, checkpoints):
    diff = logits_max_diff(family, checkpoints)
    print(f"{family} block_size={BLOCK_SIZES[family]} fp32 max|dlogit| = {diff:.2e}")
    assert diff <= FP32_ATOL_BY_FAMILY.get(family, FP32_ATOL)


@pytest.mark.parametrize(
    "family",
    ["llama3", "mistral", "opt", "gemma2", "gpt_neox"]
    + [pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3", "phi3", "mixtral")],
)
def test_logits_match_transformers_on_the_native_cpu_kernel(family, checkpoints):
    """The engine's default CPU attention (GQA, sliding window, 1-token pages; Gemma 2's
    soft cap and traced per-layer windows)."""
    from pagedjax.attention import native_cpu

    if not native_cpu.available()[0]:
        pytest.skip(native_cpu.available()[1])
    diff = logits_max_diff(family, checkpoints, attention_fn=native_cpu.ragged_paged_attention)
    print(f"{family} native_cpu fp32 max|dlogit| = {diff:.2e}")
    assert diff <= FP32_ATOL_BY_FAMILY.get(family, FP32_ATOL)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_logits_bf16_within_documented_tolerance(family, checkpoints):
    import jax.numpy as jnp

    diff = logits_max_diff(family, checkpoints, dtype=jnp.bfloat16)
    print(f"{family} bf16 max|dlogit| = {diff:.3f}")
    assert diff <= BF16_ATOL


NUM_NEW = 32
NEAR_TIE = 1e-4


def hf_greedy(model, prompt):
    """Greedy continuation and per-step top-2 logit gaps from transformers generate."""
    model.generation_config.eos_token_id = None  # never stop early; compare all 32 tokens
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=0, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps = [float(np.diff(np.sort(x[0].double().numpy())[-2:])[0]) for x in out.logits]
    return tokens, gaps


@pytest.mark.parametrize("family", list(BLOCK_SIZES))
def test_greedy_matches_transformers_generate(family, checkpoints):
    model, _, arch, params = checkpoints(family)
    rng = np.random.default_rng(7)
    prompts = [list(map(int, rng.integers(3, arch.vocab_size, n))) for n in (4, 11, 17)]
    runner = _runner(arch, params, family, seed=3)
    ours = {s: [] for s in range(len(prompts))}
    last = runner.step(list(enumerate(prompts)))  # all prompts in one ragged step
    for _ in range(NUM_NEW):
        for s in ours:
            ours[s].append(int(np.argmax(last[s][-1])))
        if len(ours[0]) == NUM_NEW:
            break
        last = runner.step([(s, [ours[s][-1]]) for s in ours])
    ties = 0
    for s, prompt in enumerate(prompts):
        ref, gaps = hf_greedy(model, prompt)
        n = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), NUM_NEW)
        ties += n < NUM_NEW
        assert ours[s][:n] == ref[:n], f"seq {s}: greedy tokens diverge (compared {n} steps)"
    print(f"{family}: {ties}/{len(prompts)} sequences stopped early at a near-tie")
    assert ties < len(prompts), "every sequence hit a near-tie: the test compared too little"


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("family", list(BLOCK_SIZES))
def test_logits_match_transformers_all_block_sizes(family, block_size, checkpoints, monkeypatch):
    """The full family x block-size cross product (the fast suite spreads block sizes)."""
    monkeypatch.setitem(BLOCK_SIZES, family, block_size)
    assert logits_max_diff(family, checkpoints) <= FP32_ATOL_BY_FAMILY.get(family, FP32_ATOL)
