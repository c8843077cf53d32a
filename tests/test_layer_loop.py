"""The layer loop: decoder layers under one ``fori_loop`` over the stacked KV pool.

The compiled step must (a) hold one layer body whatever the depth, so its program does not
grow with the number of layers, and (b) never materialize the pool or one layer of it: the
pool is carried through the loop and written in place, and the attention backends get the
whole pool plus the layer index (a ``pool[layer]`` slice handed to a custom call would be a
copy per layer per step). Both are checked on the optimized HLO, for every CPU backend and
both model families, and on the engine's whole step.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pagedjax.attention import native_cpu, ragged_paged_attention
from pagedjax.model import allocate_kv_cache, dummy_input, preset_arch, random_params
from pagedjax.model.forward import forward

NUM_BLOCKS, BLOCK = 1024, 16
BACKENDS = {"reference": ragged_paged_attention, "native_cpu": native_cpu.ragged_paged_attention}


def _compiled_forward(arch, attention_fn, num_tokens=32, num_seqs=4, max_blocks=8):
    params = jax.eval_shape(lambda: random_params(arch, dtype=jnp.float32))
    kv = jax.eval_shape(lambda: allocate_kv_cache(arch, NUM_BLOCKS, BLOCK, jnp.float32))
    fn = jax.jit(functools.partial(forward, arch=arch, attention_fn=attention_fn), donate_argnums=1)
    batch = dummy_input(num_tokens, num_seqs, max_blocks)
    return fn.lower(params, kv, batch).compile()


def _shape(dims) -> str:
    return r"f32\[" + ",".join(str(d) for d in dims) + r"\]"


def pool_copies(hlo: str, arch) -> list[str]:
    """HLO lines that copy the pool or materialize one layer of it (or one layer's K/V of
    one block range: any array of a layer's page shape)."""
    pages = (NUM_BLOCKS, arch.num_kv_heads, BLOCK, arch.head_dim)
    pool = _shape((arch.num_layers, *pages))
    layer = "(" + _shape(pages) + "|" + _shape((1, *pages)) + ")"
    bad = []
    for line in hlo.splitlines():
        if re.search(rf"= {pool}\{{[^}}]*\}} copy\(", line) or re.search(rf"= {layer}\{{", line):
            bad.append(line.strip()[:160])
    return bad


def _arch(family: str, num_layers: int):
    base = preset_arch("tiny-llama" if family == "llama" else "opt-125m")
    if family == "opt":  # a tiny OPT: the preset's structure at test width
        base = dataclasses.replace(
            base, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4,
            head_dim=16, vocab_size=512, max_position_embeddings=256, word_embed_proj_dim=None,
        )  # fmt: skip
    return dataclasses.replace(base, num_layers=num_layers, layer_windows=())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_step_never_copies_the_pool_or_a_layer_of_it(family, backend):
    arch = _arch(family, 3)
    compiled = _compiled_forward(arch, BACKENDS[backend])
    hlo = compiled.as_text()
    assert "while" in hlo, "the layers should run in one loop"
    assert pool_copies(hlo, arch) == []
    mem = compiled.memory_analysis()
    layer_bytes = NUM_BLOCKS * arch.num_kv_heads * BLOCK * arch.head_dim * 4
    assert mem.alias_size_in_bytes >= 2 * arch.num_layers * layer_bytes  # updated in place
    assert mem.temp_size_in_bytes < layer_bytes


def test_pool_copy_detector_sees_a_sliced_layer():
    """The check above can fail: a backend handed ``pool[layer]`` materializes a layer."""
    arch = _arch("llama", 3)

    def slicing_backend(q, k, v, *args, layer, **kw):
        return ragged_paged_attention(q, k[layer], v[layer], *args, **kw)

    hlo = _compiled_forward(arch, slicing_backend).as_text()
    assert pool_copies(hlo, arch) != []


def _instruction_count(hlo: str) -> int:
    return sum(1 for line in hlo.splitlines() if re.match(r"\s*(ROOT )?%\S+ = ", line))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_program_size_does_not_grow_with_depth(family):
    def count(layers: int) -> int:
        hlo = _compiled_forward(_arch(family, layers), ragged_paged_attention).as_text()
        return _instruction_count(hlo)

    small, deep = count(2), count(12)
    assert deep <= small * 1.02 + 4, (small, deep)


def test_per_layer_sliding_windows_run_under_the_loop():
    """Layers with different windows (Qwen2's max_window_layers, Gemma 2's alternation)
    pass a traced window; the result equals running each window statically."""
    from tests.model_helpers import PagedRunner

    arch = dataclasses.replace(preset_arch("tiny-llama"), num_layers=2, layer_windows=(3, None))
    params = random_params(arch, seed=1, dtype=jnp.float32, std=0.15)
    outs = {}
    for name, fn in BACKENDS.items():
        runner = PagedRunner(arch, params, block_size=4, max_tokens=16, max_seqs=2, max_len=32,
                             attention_fn=fn)  # fmt: skip
        first = runner.step([(0, list(range(5, 14))), (1, [7, 8])], all_logits=True)
        second = runner.step([(0, [20]), (1, [21, 22, 23])])
        outs[name] = (first, second)
    for a, b in zip(outs["reference"], outs["native_cpu"], strict=True):
        for sid in a:
            assert jnp.allclose(a[sid], b[sid], atol=2e-4), sid
    # A window of 3 changes the logits of long prompts (else the test could not fail).
    full = dataclasses.replace(arch, layer_windows=(None, None))
    # attention_fn spelled out: make_forward's cache would otherwise share this runner's
    # jit with other tests' runners of the tiny-llama preset (same arch, other shapes).
    runner = PagedRunner(full, params, block_size=4, max_tokens=16, max_seqs=2, max_len=32,
                         attention_fn=ragged_paged_attention)  # fmt: skip
    plain = runner.step([(0, list(range(5, 14))), (1, [7, 8])], all_logits=True)
    assert not jnp.allclose(plain[0][-1], outs["reference"][0][0][-1], atol=1e-3)
