"""pagedjax.lora: the PEFT loader's refusals, the slot table's padding and bookkeeping, the
gathered and grouped delta against numpy, no recompile on adapter swaps, and the model's
forward with adapters against transformers + peft (a mixed batch: base rows and two
different adapters)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.attention import PAD_SLOT
from pagedjax.lora import (
    LoRARequest,
    LoRASlotTable,
    llama_module_shapes,
    load_peft_adapter,
    lora_delta,
    lora_delta_grouped,
)
from pagedjax.model import ModelInput, allocate_kv_cache, make_forward

SHAPES = {"q_proj": (8, 8), "v_proj": (8, 4), "down_proj": (12, 8)}


def _np_delta(x, ids, a, b, scale):
    return np.stack([x[i] @ a[s] @ b[s] * scale[s] for i, s in enumerate(ids)])


def _random_table(rng, slots, d_in, d_out, r):
    a = rng.normal(size=(slots, d_in, r)).astype(np.float32)
    b = rng.normal(size=(slots, r, d_out)).astype(np.float32)
    a[0], b[0] = 0, 0
    return a, b, rng.uniform(0.5, 2, size=slots).astype(np.float32)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), slots=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_gathered_and_grouped_equal_numpy(rows, slots, seed):
    rng = np.random.default_rng(seed)
    a, b, scale = _random_table(rng, slots, 6, 5, 3)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    ids = rng.integers(0, slots, rows).astype(np.int32)
    want = _np_delta(x, ids, a, b, scale)
    for fn in (lora_delta, lora_delta_grouped):
        got = np.asarray(fn(x, ids, a, b, scale))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.all(got[ids == 0] == 0)  # slot 0: exactly no delta


def test_swapping_adapter_contents_does_not_recompile():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    ids = jnp.asarray([0, 1, 2, 1], jnp.int32)
    for fn in (lora_delta, lora_delta_grouped):
        fn.clear_cache()
        for seed in range(3):  # new weights, scales and slot ids: same shapes
            a, b, scale = _random_table(np.random.default_rng(seed), 3, 6, 5, 3)
            fn(x, jnp.roll(ids, seed), a, b, scale).block_until_ready()
        assert fn._cache_size() == 1


def _write_adapter(directory, *, r=2, alpha=4, modules=SHAPES, layers=2, seed=0, **cfg):
    """A PEFT-layout adapter written by hand (the loader's refusals; peft writes the one
    the parity test uses). Returns {module: (A [L, in, r], B [L, r, out])} in pagedjax's
    orientation."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors, want = {}, {}
    for m, (d_in, d_out) in modules.items():
        group = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
        a = rng.normal(size=(layers, r, d_in)).astype(np.float32)
        b = rng.normal(size=(layers, d_out, r)).astype(np.float32)
        for i in range(layers):
            base = f"base_model.model.model.layers.{i}.{group}.{m}"
            tensors[f"{base}.lora_A.weight"], tensors[f"{base}.lora_B.weight"] = a[i], b[i]
        want[m] = (a.transpose(0, 2, 1), b.transpose(0, 2, 1))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=list(modules),
                  bias="none", **cfg)  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return want


def test_loader_reads_weights_and_scale(tmp_path):
    want = _write_adapter(tmp_path / "a", r=2, alpha=4)
    ad = load_peft_adapter(tmp_path / "a", SHAPES, 2, max_lora_rank=4)
    assert ad.rank == 2 and ad.scale == 2.0 and set(ad.weights) == set(SHAPES)
    for m, (a, b) in want.items():
        np.testing.assert_array_equal(ad.weights[m][0], a)
        np.testing.assert_array_equal(ad.weights[m][1], b)
    _write_adapter(tmp_path / "rs", r=4, alpha=4, use_rslora=True)
    assert load_peft_adapter(tmp_path / "rs", SHAPES, 2, 4).scale == 2.0  # 4 / sqrt(4)


@pytest.mark.parametrize(
    ("kwargs", "load", "match"),
    [
        (dict(r=8), {}, "rank 8 exceeds max_lora_rank=4"),
        (dict(modules={"k_proj": (8, 4)}), {}, "k_proj"),
        (dict(), dict(module_shapes={**SHAPES, "q_proj": (8, 16)}), "another base"),
        (dict(), dict(num_layers=1), "layer 1"),
        (dict(use_dora=True), {}, "DoRA"),
        (dict(rank_pattern={"q_proj": 4}), {}, "rank_pattern"),
        (dict(modules_to_save=["lm_head"]), {}, "modules_to_save"),
    ],
)
def test_loader_refusals(tmp_path, kwargs, load, match):
    _write_adapter(tmp_path, **kwargs)
    args = dict(module_shapes=SHAPES, num_layers=2, max_lora_rank=4) | load
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(tmp_path, **args)


def test_loader_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="missing adapter_config.json"):
        load_peft_adapter(tmp_path, SHAPES, 2, 4)
    _write_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match="corrupt adapter_model.safetensors"):
        load_peft_adapter(tmp_path, SHAPES, 2, 4)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing adapter_model.safetensors"):
        load_peft_adapter(tmp_path, SHAPES, 2, 4)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt adapter_config.json"):
        load_peft_adapter(tmp_path, SHAPES, 2, 4)


def test_slot_table_pads_and_tracks_ids(tmp_path):
    want = _write_adapter(tmp_path / "a", r=2, alpha=2)
    table = LoRASlotTable(SHAPES, num_layers=2, max_loras=2, max_lora_rank=4)
    req = LoRARequest("a", 7, str(tmp_path / "a"))
    assert table.add(req) == 1 and table.add(LoRARequest("again", 7, "x")) == 1
    a, b = want["q_proj"]
    np.testing.assert_array_equal(np.asarray(table.a["q_proj"][:, 1, :, :2]), a)
    assert not np.any(np.asarray(table.a["q_proj"][:, 1, :, 2:]))  # zero padding
    assert not np.any(np.asarray(table.b["q_proj"][:, 0]))  # slot 0: no adapter
    # The padded table's delta equals the unpadded adapter's.
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    ids = table.slot_ids([7, None, 7])
    got = lora_delta(x, ids, table.a["q_proj"][0], table.b["q_proj"][0], table.scale)
    np.testing.assert_allclose(np.asarray(got)[[0, 2]], x[[0, 2]] @ a[0] @ b[0], rtol=1e-5)
    with pytest.raises(ValueError, match="unknown LoRA adapter id 9"):
        table.slot_of(9)
    table.add(LoRARequest("b", 8, str(tmp_path / "a")))
    with pytest.raises(ValueError, match="slots are in use"):
        table.add(LoRARequest("c", 9, str(tmp_path / "a")))
    table.remove(7)
    assert not np.any(np.asarray(table.a["q_proj"][:, 1])) and table.slot_of(8) == 2
    with pytest.raises(ValueError, match="lora_int_id must be"):
        LoRARequest("zero", 0, "x")


# --- the model forward against transformers + peft -------------------------------------


def _prefill_batch(seqs, slot_of_seq, block_size, max_blocks):
    """One prefill step of every sequence (own contiguous pages), every token's logits."""
    tokens, pos, slots, lora, bt, cu = [], [], [], [], [], [0]
    for s, toks in enumerate(seqs):
        first = 1 + s * max_blocks
        tokens += toks
        pos += range(len(toks))
        slots += [(first + p // block_size) * block_size + p % block_size for p in range(len(toks))]
        lora += [slot_of_seq[s]] * len(toks)
        bt.append(list(range(first, first + max_blocks)))
        cu.append(len(tokens))
    pad = 16 - len(tokens)
    return ModelInput(
        tokens=jnp.asarray(tokens + [0] * pad, jnp.int32),
        positions=jnp.asarray(pos + [0] * pad, jnp.int32),
        slot_mapping=jnp.asarray(slots + [PAD_SLOT] * pad, jnp.int32),
        block_tables=jnp.asarray(bt, jnp.int32),
        kv_lens=jnp.asarray([len(t) for t in seqs], jnp.int32),
        cu_q_lens=jnp.asarray(cu, jnp.int32),
        logits_indices=jnp.arange(16, dtype=jnp.int32),
        lora_slots=jnp.asarray(lora + [0] * pad, jnp.int32),
    )


@pytest.mark.tier2
def test_forward_matches_transformers_peft_mixed_batch(tmp_path):
    pytest.importorskip("peft")
    from model_helpers import hf_logits, make_tiny_hf_model, peft_adapter

    from pagedjax.model.loader import load_hf_checkpoint

    base = make_tiny_hf_model("llama", seed=0, num_key_value_heads=2)
    base.save_pretrained(str(tmp_path / "base"))
    arch, params = load_hf_checkpoint(tmp_path / "base")
    attn_mlp = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_models = [
        peft_adapter(base, tmp_path / "a1", 1, 4, attn_mlp),
        peft_adapter(base, tmp_path / "a2", 2, 2, ["q_proj", "v_proj", "down_proj"]),
    ]
    table = LoRASlotTable(llama_module_shapes(arch), arch.num_layers, max_loras=3,
                          max_lora_rank=8)  # fmt: skip
    slot1 = table.add(LoRARequest("a1", 11, str(tmp_path / "a1")))
    slot2 = table.add(LoRARequest("a2", 22, str(tmp_path / "a2")))
    seqs = [[5, 9, 3, 7, 1], [5, 9, 3, 7], [2, 8, 4, 6, 11, 12]]  # base, a2, a1
    batch = _prefill_batch(seqs, [0, slot2, slot1], block_size=4, max_blocks=2)
    kv = allocate_kv_cache(arch, 1 + 3 * 2, 4, jnp.float32)
    forward = make_forward(arch)
    _, logits = forward(table.attach(params), kv, batch)
    logits = np.asarray(logits)
    start = 0
    for toks, model in zip(seqs, [base, peft_models[1], peft_models[0]], strict=True):
        want = hf_logits(model, toks)
        np.testing.assert_allclose(logits[start : start + len(toks)], want, atol=1e-5, rtol=1e-5)
        start += len(toks)
    assert np.abs(hf_logits(peft_models[0], seqs[2]) - hf_logits(base, seqs[2])).max() > 1e-2
    # Swapping an adapter (new contents, same table shapes) does not recompile the step.
    before = forward._cache_size()
    table.remove(22)
    table.add(LoRARequest("a1-again", 33, str(tmp_path / "a1")))
    kv = allocate_kv_cache(arch, 1 + 3 * 2, 4, jnp.float32)
    _, logits2 = forward(table.attach(params), kv, batch)
    assert forward._cache_size() == before
    np.testing.assert_allclose(np.asarray(logits2)[:5], logits[:5], atol=1e-6)  # base rows
    np.testing.assert_allclose(np.asarray(logits2)[9:15], logits[9:15], atol=1e-6)  # a1 rows
    # Adapters attached but no per-token slots: the base model on every row.
    kv = allocate_kv_cache(arch, 1 + 3 * 2, 4, jnp.float32)
    _, plain = forward(table.attach(params), kv, batch._replace(lora_slots=None))
    np.testing.assert_allclose(np.asarray(plain)[9:15], hf_logits(base, seqs[2]), atol=1e-5)
