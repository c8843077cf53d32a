"""Quantized linear weights (pagedjax/model/quant): the representation and its matmul,
the in-flight modes' error bounds, the pre-quantized checkpoint loaders against
checkpoints written here in the published layouts from known quantized values, and the
GGUF block formats against ``gguf.quants.dequantize`` on random block bytes.

Loader tests: the known values are random integer codes, zero points and scales; the
checkpoint stores them in the format's layout; the loaded ``QuantizedWeight`` must
dequantize to exactly (q - z) * s, and the model's logits must equal those of the dense
model built from the same dequantized weights within float32 rounding.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import PagedRunner

from pagedjax.model import preset_arch, random_params
from pagedjax.model.quant.hf_formats import (
    act_order_perm,
    awq_to_codes,
    codes_to_awq,
    pack_int32,
    unpack_int32,
)
from pagedjax.model.quant.inflight import (
    INFLIGHT_MODES,
    NF4_CODEBOOK,
    QUANTIZERS,
    error_bound,
    quantize_params,
    quantized_nbytes,
)
from pagedjax.model.quant.methods import load_quantized_checkpoint, resolve_method
from pagedjax.model.quant.weight import (
    QuantizedWeight,
    dequantize,
    pack_nibbles,
    quantized_matmul,
    unpack_nibbles,
)

# A Llama whose every linear input (hidden 128, heads 8 x 16, intermediate 256) is a
# multiple of 128, so each mode's group size divides it.
ARCH = dataclasses.replace(
    preset_arch("tiny-llama"), hidden_size=128, intermediate_size=256, num_heads=8,
    num_kv_heads=2, head_dim=16, vocab_size=256,
)  # fmt: skip
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _weights(rng, n_in=256, n_out=64) -> np.ndarray:
    """Gaussian weights with one outlier column and one all-zero group (the corner cases
    of absmax scaling)."""
    w = rng.normal(0, 0.02, (n_in, n_out)).astype(np.float32)
    w[:, 3] *= 40.0
    w[:128, 5] = 0.0
    return w


@pytest.mark.parametrize("mode", INFLIGHT_MODES)
def test_in_flight_error_within_the_format_bound(mode):
    rng = np.random.default_rng(0)
    w = _weights(rng)
    q = QUANTIZERS[mode](w)
    err = np.abs(w - np.asarray(dequantize(q)))
    bound = error_bound(w, q)
    assert (err <= bound).all(), float((err / bound).max())
    assert np.asarray(dequantize(q))[:128, 5].tolist() == [0.0] * 128  # a zero group stays 0
    # The bound is tight, not vacuous: the worst error uses a good part of it.
    assert (err / bound).max() > 0.3
    assert q.nbytes() < w.nbytes / (1.9 if q.bits == 8 else 3.5)
    assert q.nbytes() == quantized_nbytes(mode, *w.shape)  # the benchmark's table formula


def test_nf4_uses_the_bitsandbytes_levels():
    w = np.linspace(-1, 1, 64, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    q = QUANTIZERS["nf4"](w)
    got = np.asarray(dequantize(q))[:, 0]
    book = np.asarray(NF4_CODEBOOK, np.float32)
    assert np.isin(got, book).all()  # every value is a level times the absmax (1 here)
    assert got[0] == -1.0 and got[-1] == 1.0


def test_nibble_and_int32_packing_round_trip():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (64, 24)).astype(np.uint8)
    assert (np.asarray(unpack_nibbles(jnp.asarray(pack_nibbles(codes)))) == codes).all()
    for bits in (4, 8):
        c = rng.integers(0, 1 << bits, (64, 32)).astype(np.uint8)
        for axis in (0, 1):
            assert (unpack_int32(pack_int32(c, bits, axis), bits, axis) == c).all()
    assert (awq_to_codes(codes_to_awq(codes[:, :16])) == codes[:, :16]).all()
    # AWQ's interleave: a word holding columns 0..7 stores them as 0 2 4 6 1 3 5 7.
    word = codes_to_awq(np.arange(8, dtype=np.uint8)[None, :])[0, 0].view(np.uint32)
    assert [(int(word) >> (4 * k)) & 0xF for k in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_act_order_perm_sorts_rows_by_group_and_refuses_unequal_groups():
    assert act_order_perm(None, 8, 2, "g") is None
    assert act_order_perm(np.array([0, 0, 0, 0, 1, 1, 1, 1]), 8, 2, "g") is None  # contiguous
    g_idx = np.array([1, 0, 1, 0, 0, 1, 1, 0])
    perm = act_order_perm(g_idx, 8, 2, "g")
    np.testing.assert_array_equal(g_idx[perm], [0, 0, 0, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="m.g_idx: must give each of 2 groups 4 rows"):
        act_order_perm(np.array([1, 0, 1, 0, 0, 1, 1, 1]), 8, 2, "m.g_idx")
    with pytest.raises(ValueError, match=r"m.g_idx: shape \(4,\), expected \(8,\)"):
        act_order_perm(np.array([0, 0, 1, 1]), 8, 2, "m.g_idx")


def _random_qweight(rng, n_in, n_out, *, bits=4, group=32, zero=False, offset=False,
                    perm=False, codebook=False, act="none", fp8=False):  # fmt: skip
    g = n_in // group
    if fp8:
        data = rng.normal(0, 50, (n_in, n_out)).astype(jnp.float8_e4m3fn)
    else:
        codes = rng.integers(0, 1 << bits, (n_in, n_out)).astype(np.uint8)
        data = pack_nibbles(codes) if bits <= 4 else codes
    return QuantizedWeight(
        jnp.asarray(data),
        jnp.asarray(rng.uniform(0.5, 2.0, (g, n_out)).astype(np.float32) * 0.01),
        zero=jnp.asarray(rng.integers(0, 1 << bits, (g, n_out)).astype(np.uint8)) if zero else None,
        offset=jnp.asarray(rng.normal(0, 0.01, (g, n_out)).astype(np.float32)) if offset else None,
        perm=jnp.asarray(rng.permutation(n_in).astype(np.int32)) if perm else None,
        in_features=n_in, bits=bits, group_size=group,
        code_offset=0 if (zero or offset or codebook or fp8) else 1 << (bits - 1),
        codebook=NF4_CODEBOOK if codebook else None, act_quant=act,
    ).check()  # fmt: skip


CASES = {
    "sym4": {}, "zero4": dict(zero=True), "offset4": dict(offset=True),
    "perm_zero4": dict(zero=True, perm=True), "nf4": dict(codebook=True),
    "zero8": dict(bits=8, zero=True), "q6_group16": dict(bits=6, group=16, offset=True),
    "fp8_w8a8": dict(fp8=True, group=128, act="fp8"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_matmul_equals_dense_product_of_the_dequantized_weight(case):
    """Both forms (grouped partial dot for T <= group, dequantize-then-dot above) equal
    x @ dequantize(w) within float32 rounding, jitted, with a leading batch axis."""
    rng = np.random.default_rng(2)
    w = _random_qweight(rng, 128, 48, **CASES[case])
    dense = np.asarray(dequantize(w), np.float64)
    fn = jax.jit(quantized_matmul)
    for tokens in (1, 5, 40):
        x = rng.normal(0, 1, (tokens, 128)).astype(np.float32)
        if w.act_quant == "fp8":  # the activations are rounded first, per token
            s = np.abs(x).max(-1, keepdims=True) / 448
            x = (x / s).astype(jnp.float8_e4m3fn).astype(np.float32) * s
        want = x.astype(np.float64) @ dense
        got = np.asarray(fn(jnp.asarray(x), w), np.float64)
        tol = 2e-6 * np.abs(x).astype(np.float64) @ np.abs(dense) + 1e-6
        assert (np.abs(got - want) <= tol).all(), (tokens, np.abs(got - want).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matmul_in_16_bit_runs_on_the_cpu(dtype):
    """The grouped form with 16-bit activations (XLA's CPU dot has no 16-bit x 16-bit ->
    f32 batched form, so it widens first): equals the float32 product of the same 16-bit
    inputs, rounded once to the output dtype."""
    rng = np.random.default_rng(5)
    w = _random_qweight(rng, 128, 48, zero=True)
    x = jnp.asarray(rng.normal(0, 1, (5, 128)), dtype)
    got = jax.jit(quantized_matmul)(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(dequantize(w, dtype), np.float64)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=1e-2)


def test_check_refuses_inconsistent_weights():
    rng = np.random.default_rng(3)
    good = _random_qweight(rng, 64, 8)
    with pytest.raises(ValueError, match="group_size"):
        dataclasses.replace(good, group_size=48).check()
    with pytest.raises(ValueError, match="rows"):
        dataclasses.replace(good, in_features=128, group_size=32).check()
    with pytest.raises(ValueError, match="scale shape"):
        dataclasses.replace(good, scale=good.scale[:1, :3]).check()
    with pytest.raises(ValueError, match="not a multiple of 32"):
        QUANTIZERS["int4"](np.ones((48, 8), np.float32))
    assert QUANTIZERS["int4"](np.ones((576, 8), np.float32)).group_size == 64  # SmolLM2
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_params({}, "int3")


# ---------------------------------------------------------------- model-level helpers


def _hf_tensors(params, arch) -> dict[str, np.ndarray]:
    """Our params -> an HF Llama tensor dict (torch layout), for writing checkpoints."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [p.key for p in path]
        arr = np.asarray(leaf, np.float32)
        hf_leaf = {"kernel": "weight", "embedding": "weight"}.get(keys[-1], keys[-1])
        if keys[0] == "layers":
            for i in range(arr.shape[0]):
                a = arr[i].T if keys[-1] == "kernel" else arr[i]
                out[".".join(["model.layers", str(i), *keys[1:-1], hf_leaf])] = a
        else:
            a = arr.T if keys[-1] == "kernel" else arr
            prefix = [] if keys[0] == "lm_head" else ["model"]
            out[".".join([*prefix, *keys[:-1], hf_leaf])] = a
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _write_checkpoint(directory, arch, tensors, quantization_config):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.norm_eps,
        tie_word_embeddings=False, quantization_config=quantization_config,
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(directory / "model.safetensors"))


def _logits(arch, params):
    rng = np.random.default_rng(7)
    toks = [int(t) for t in rng.integers(3, arch.vocab_size, 20)]
    r = PagedRunner(arch, params, block_size=8, max_tokens=24, max_seqs=1, max_len=32)
    prefill = r.step([(0, toks[:19])], all_logits=True)[0]
    decode = r.step([(0, toks[19:])])[0]
    return np.concatenate([prefill, decode])


def _dense_twin(params):
    """The same model with every QuantizedWeight dequantized (float32)."""
    def one(leaf):
        if not isinstance(leaf, QuantizedWeight):
            return leaf
        n = leaf.data.shape[0]
        layers = [dequantize(jax.tree.map(lambda a, i=i: a[i], leaf)) for i in range(n)]
        return jnp.stack(layers)

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def _kernel(params, role, layer):
    node = params["layers"]
    for part in role.split("."):
        node = node[part]
    return jax.tree.map(lambda a: a[layer], node["kernel"])


def _check_model(directory, arch, known):
    """Loaded weights dequantize to the known values exactly; logits equal the dense
    twin's within float32 rounding."""
    got_arch, params = load_quantized_checkpoint(directory)
    assert got_arch.hidden_size == arch.hidden_size
    for (role, layer), want in known.items():
        w = _kernel(params, role, layer)
        assert isinstance(w, QuantizedWeight)
        np.testing.assert_array_equal(np.asarray(dequantize(w)), want)
    # W8A8 checkpoints also round activations per token; the dense twin cannot, so the
    # exact comparison runs with that off (the rounding itself: the matmul tests).
    weight_only = _without_activation_quant(params)
    ours, twin = _logits(arch, weight_only), _logits(arch, _dense_twin(params))
    np.testing.assert_allclose(ours, twin, rtol=1e-4, atol=1e-4 * np.abs(twin).max())
    return params


def _without_activation_quant(params):
    return jax.tree.map(
        lambda w: dataclasses.replace(w, act_quant="none") if isinstance(w, QuantizedWeight)
        else w, params, is_leaf=lambda x: isinstance(x, QuantizedWeight),
    )  # fmt: skip


def _base_tensors():
    return _hf_tensors(random_params(ARCH, 0, jnp.float32, std=0.05), ARCH)


@pytest.mark.tier2  # second tier (docs/testing.md): 15 s cold; GPTQ and compressed-tensors stay
def test_awq_checkpoint_loads_exactly(tmp_path):
    rng = np.random.default_rng(4)
    tensors, known, group = _base_tensors(), {}, 32
    for i in range(ARCH.num_layers):
        for role in LINEARS:
            name = f"model.layers.{i}.{role}"
            n_out, n_in = tensors.pop(f"{name}.weight").shape
            q = rng.integers(0, 16, (n_in, n_out)).astype(np.uint8)
            z = rng.integers(0, 16, (n_in // group, n_out)).astype(np.uint8)
            s = rng.uniform(0.001, 0.01, (n_in // group, n_out)).astype(np.float16)
            tensors[f"{name}.qweight"] = codes_to_awq(q)
            tensors[f"{name}.qzeros"] = codes_to_awq(z)
            tensors[f"{name}.scales"] = s
            zz, ss = np.repeat(z, group, 0), np.repeat(s.astype(np.float32), group, 0)
            known[(role, i)] = (q.astype(np.float32) - zz) * ss
    qc = dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm")
    _write_checkpoint(tmp_path / "awq", ARCH, tensors, qc)
    assert resolve_method(None, tmp_path / "awq") == "awq"
    _check_model(tmp_path / "awq", ARCH, known)


@pytest.mark.parametrize("bits,sym,desc_act", [
    (4, True, True), pytest.param(8, False, False, marks=pytest.mark.slow),
])  # fmt: skip
def test_gptq_checkpoint_loads_exactly(tmp_path, bits, sym, desc_act):
    rng = np.random.default_rng(5)
    tensors, known, group = _base_tensors(), {}, 32
    for i in range(ARCH.num_layers):
        for role in LINEARS:
            name = f"model.layers.{i}.{role}"
            n_out, n_in = tensors.pop(f"{name}.weight").shape
            g = n_in // group
            q = rng.integers(0, 1 << bits, (n_in, n_out)).astype(np.uint8)
            z = (np.full((g, n_out), 1 << (bits - 1)) if sym
                 else rng.integers(1, 1 << bits, (g, n_out))).astype(np.uint8)  # fmt: skip
            s = rng.uniform(0.001, 0.01, (g, n_out)).astype(np.float16)
            # desc_act: groups follow a random order of the input rows.
            order = rng.permutation(n_in) if desc_act else np.arange(n_in)
            g_idx = np.empty(n_in, np.int32)
            g_idx[order] = np.arange(n_in) // group
            tensors[f"{name}.qweight"] = pack_int32(q, bits, axis=0)
            tensors[f"{name}.qzeros"] = pack_int32(z - 1, bits, axis=1)  # the stored offset
            tensors[f"{name}.scales"] = s
            tensors[f"{name}.g_idx"] = g_idx
            known[(role, i)] = (q.astype(np.float32) - z[g_idx]) * s.astype(np.float32)[g_idx]
    qc = dict(quant_method="gptq", bits=bits, group_size=group, desc_act=desc_act, sym=sym)
    _write_checkpoint(tmp_path / "gptq", ARCH, tensors, qc)
    params = _check_model(tmp_path / "gptq", ARCH, known)
    assert (_kernel(params, "mlp.up_proj", 0).perm is not None) == desc_act


def _ct_config(fmt, bits, strategy, group, act_type=None):
    weights = dict(num_bits=bits, type="float" if fmt == "float-quantized" else "int",
                   symmetric=True, strategy=strategy, group_size=group)  # fmt: skip
    acts = None if act_type is None else dict(num_bits=8, type=act_type, dynamic=True,
                                              strategy="token", symmetric=True)  # fmt: skip
    return dict(quant_method="compressed-tensors", format=fmt,
                config_groups={"group_0": dict(targets=["Linear"], weights=weights,
                                               input_activations=acts)},
                ignore=["lm_head"])  # fmt: skip


@pytest.mark.parametrize("scheme", [
    "w4a16_group", "fp8_channel", "w4a16_actorder",
    *(pytest.param(s, marks=pytest.mark.slow)
      for s in ("w8a16_channel", "w8a8_int", "fp8_tensor")),
])  # fmt: skip
def test_compressed_tensors_checkpoint_loads_exactly(tmp_path, scheme):
    """w4a16_actorder: llm-compressor's GPTQ with ``actorder: "group"`` (before
    compressed-tensors 0.20 removed it; RedHatAI's w4a16 models carry it): weight_packed
    in the checkpoint's column order, ``weight_g_idx`` [in] naming each input's group."""
    rng = np.random.default_rng(6)
    tensors, known = _base_tensors(), {}
    bits = 4 if scheme.startswith("w4a16") else 8
    group = 32 if scheme.startswith("w4a16") else None
    for i in range(ARCH.num_layers):
        for role in LINEARS:
            name = f"model.layers.{i}.{role}"
            n_out, n_in = tensors.pop(f"{name}.weight").shape
            cols = 1 if group is None else n_in // group
            s = rng.uniform(0.001, 0.01, (n_out, cols)).astype(np.float32)
            if scheme == "fp8_tensor":
                s = s[:1, :1].reshape(1)
            if scheme.startswith("fp8"):
                v = np.clip(rng.normal(0, 100, (n_out, n_in)), -440, 440)
                v = v.astype(jnp.float8_e4m3fn)
                tensors[f"{name}.weight"] = v
                vals = v.astype(np.float32)
            elif scheme == "w8a8_int":
                v = rng.integers(-127, 128, (n_out, n_in)).astype(np.int8)
                tensors[f"{name}.weight"] = v
                vals = v.astype(np.float32)
            else:
                v = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (n_out, n_in))
                offset = (v + (1 << (bits - 1))).astype(np.uint8)  # what pack_to_int32 stores
                tensors[f"{name}.weight_packed"] = pack_int32(offset, bits, axis=1)
                tensors[f"{name}.weight_shape"] = np.array([n_out, n_in], np.int64)
                vals = v.astype(np.float32)
            tensors[f"{name}.weight_scale"] = s
            s2 = s.reshape(1, 1) if s.size == 1 else s  # [out or 1, groups]
            s_full = np.repeat(np.broadcast_to(s2, (n_out, s2.shape[1])), n_in // s2.shape[1], 1)
            if scheme == "w4a16_actorder":  # groups follow a random order of the inputs
                g_idx = np.empty(n_in, np.int32)
                g_idx[rng.permutation(n_in)] = np.arange(n_in) // group
                tensors[f"{name}.weight_g_idx"] = g_idx
                s_full = s[:, g_idx]
            known[(role, i)] = (vals * s_full).T
    fmt, act = {
        "w4a16_group": ("pack-quantized", None), "w8a16_channel": ("pack-quantized", None),
        "w4a16_actorder": ("pack-quantized", None),
        "w8a8_int": ("int-quantized", "int"), "fp8_channel": ("float-quantized", "float"),
        "fp8_tensor": ("float-quantized", "float"),
    }[scheme]  # fmt: skip
    strategy = "group" if group else ("tensor" if scheme == "fp8_tensor" else "channel")
    qc = _ct_config(fmt, bits, strategy, group, act)
    if scheme == "w4a16_actorder":
        qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    _write_checkpoint(tmp_path / "ct", ARCH, tensors, qc)
    params = _check_model(tmp_path / "ct", ARCH, known)
    assert (_kernel(params, "mlp.up_proj", 0).perm is not None) == (scheme == "w4a16_actorder")
    assert _kernel(params, "self_attn.q_proj", 0).act_quant == {None: "none", "int": "int8",
                                                               "float": "fp8"}[act]  # fmt: skip


def test_method_resolution_follows_vllm(tmp_path):
    _write_checkpoint(tmp_path / "awq", ARCH, {}, dict(quant_method="awq"))
    assert resolve_method(None, None) is None
    assert resolve_method("int4", None) == "int4"
    assert resolve_method("awq", tmp_path / "awq") == "awq"
    with pytest.raises(ValueError, match="cannot be applied"):
        resolve_method("int4", tmp_path / "awq")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        resolve_method("gptq", None)
    _write_checkpoint(tmp_path / "bnb", ARCH, {}, dict(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match="not supported"):
        resolve_method(None, tmp_path / "bnb")
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_method("int3", None)


@pytest.mark.parametrize("mode", INFLIGHT_MODES)
def test_in_flight_model_runs_every_linear_quantized(mode):
    """quantize_params swaps every decoder linear (not the embedding / LM head); the
    model's logits equal its dense twin's (the dequantized weights), up to float32 and,
    for fp8, the activation rounding; and stay close to the unquantized model's."""
    params = random_params(ARCH, 0, jnp.float32, std=0.05)
    qp = quantize_params(params, mode)
    for role in LINEARS:
        assert isinstance(_kernel(qp, role, 0), QuantizedWeight)
    assert not isinstance(qp["lm_head"]["kernel"], QuantizedWeight)
    ref, ours, twin = _logits(ARCH, params), _logits(ARCH, qp), _logits(ARCH, _dense_twin(qp))
    scale = np.abs(ref).max()
    if QUANTIZERS[mode](np.ones((128, 1), np.float32)).act_quant == "none":
        np.testing.assert_allclose(ours, twin, rtol=1e-4, atol=1e-5 * scale)
    # A random model has no structure to preserve; only ask that the logits still track
    # the unquantized ones (the real model's agreement: test_quantized_real_model.py).
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.9


def test_orbax_round_trip_keeps_every_format(tmp_path):
    """save_params / restore_params: quantized weights come back packed and identical
    (int4 codes, NF4 code book, fp8 data, int8), the formats from quant.json."""
    from pagedjax.model import restore_params, save_params

    params = random_params(ARCH, 0, jnp.float32)
    for mode in ("int4", "nf4", "fp8_per_channel", "int8_per_channel_weight_only"):
        qp = quantize_params(params, mode)
        save_params(tmp_path / mode, ARCH, qp)
        arch, back = restore_params(tmp_path / mode)
        assert arch == ARCH
        assert jax.tree.structure(back) == jax.tree.structure(qp)  # formats included
        for a, b in zip(jax.tree.leaves(qp), jax.tree.leaves(back), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("family", ["opt", pytest.param("gpt_neox", marks=pytest.mark.slow)])
def test_other_families_run_quantized_linears(family):
    """OPT and GPT-NeoX build their projections with the same layers.linear: in-flight
    int8 reaches them, and their logits equal the dense twin's."""
    from model_helpers import TINY_HF_CONFIGS

    from pagedjax.model import arch_from_hf_config

    _, cfg = TINY_HF_CONFIGS[family]
    arch = arch_from_hf_config(dict(cfg, model_type=family))
    qp = quantize_params(random_params(arch, 0, jnp.float32, std=0.05),
                         "int8_per_channel_weight_only")  # fmt: skip
    kernels = [x for x in jax.tree.leaves(qp["layers"], is_leaf=lambda x: isinstance(
        x, QuantizedWeight)) if isinstance(x, QuantizedWeight)]  # fmt: skip
    assert len(kernels) >= 4
    ours, twin = _logits(arch, qp), _logits(arch, _dense_twin(qp))
    np.testing.assert_allclose(ours, twin, rtol=1e-4, atol=1e-5 * np.abs(twin).max())
