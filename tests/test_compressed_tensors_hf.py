"""compressed-tensors checkpoints against transformers: the same files, written by
compressed-tensors' own compressors, run by transformers (which decompresses them on the
CPU) and served by ``LLM(model=dir)`` with no quantization flag; the log-probabilities
over the whole vocabulary at every prompt and generated position, and the greedy
continuations, agree.

How a checkpoint is made here, as llm-compressor makes one: a random tiny transformers
Llama, ``apply_quantization_config`` with the scheme, weight scales from each channel's
(or group's) min / max through compressed-tensors' ``calculate_qparams`` (what
llm-compressor's memoryless min-max weight observer feeds it; llm-compressor itself is
not a test dependency), then ``ModelCompressor.compress_model`` (compressed-tensors
quantizes, packs and names the tensors), ``save_pretrained`` and ``update_config`` (the
library writes config.json's ``quantization_config``). No tensor layout is written here.

What transformers runs (5.24, compressed-tensors 0.20, CPU, float32): the weights are
decompressed on the first forward (q * scale, the one float32 rounding pagedjax's
dequantization also makes: checked bit for bit, ``_assert_same_weights``) and each
quantized Linear keeps compressed-tensors' forward, which for the W8A8 schemes rounds its
input per token (dynamic scales), as pagedjax does. Compared: pagedjax's log-probabilities
over the whole vocabulary at the 8 generated positions (logprobs; the first is the
prefill's last) and, where the case asks, at the 40 prompt positions (prompt_logprobs),
against transformers' on the same tokens; they are the logits up to each row's constant,
all that sampling sees. Bounds on the largest difference:

- weight-only (W4A16 group 32, W8A16 per channel): 1e-4 x max |log-probability|; the
  same float32 weights, only the summation order differs (measured ~1e-5 of ~14).
- FP8 W8A8 (dynamic per token; per-channel and per-tensor weights): both sides take
  scale = absmax / 448 and round x / scale to E4M3, the same arithmetic, so most rows
  agree to float32 rounding; but an activation lying on a rounding boundary can round
  the other way after a float32-sized difference upstream (one E4M3 step, 1/16 of it),
  and then that token and the ones attending to it move. The bound is therefore half of
  what activation rounding itself does to this model (transformers' output with it on vs
  off, ``_activation_rounding_effect``): a boundary flip stays far below (measured 0.01 of
  it), while no rounding at all, or a different rule, reaches ~1.
- int8 W8A8: compressed-tensors' forward rounds each token on absmax / 127.5 (codes in
  [-128, 127]); pagedjax, like vLLM's serving kernel (``scaled_int8_quant``), on
  absmax / 127 (codes in +-127). Against compressed-tensors' own rule the two grids round
  every activation independently: bound 2x the rounding effect (two independent
  roundings differ by about sqrt(2) times one; measured 1.1-1.5). With compressed-tensors'
  rule set to vLLM's for the run (``_vllm_int8_activation_rule``), the FP8 bound (half
  the effect; measured 0.13, the boundary flips of int8) and the greedy check.

Greedy: the 8 generated tokens equal transformers' ``generate``; where they part, the
step must be a near-tie that the measured difference explains (top-2 gap in transformers
within twice that row's largest difference), and the token comparison ends there.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

pytest.importorskip("compressed_tensors", reason="the test extra installs compressed-tensors")

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.model.quant.weight import QuantizedWeight, dequantize  # noqa: E402
from tests.model_helpers import make_tiny_hf_model  # noqa: E402

# Second tier (docs/testing.md): subprocesses and extra compiles.
pytestmark = [pytest.mark.tier2]

# Hidden 128 / intermediate 256 (GQA 8 / 2 heads), so a group of 32 splits every input.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8,
             num_key_value_heads=2)  # fmt: skip
VOCAB = 384  # tiny llama's
N_NEW = 8
PROMPT_LEN = 40  # > the group of 32: in one step, the dequantize-then-dot form (weight.py)
MAX_LEN = 64


def _scheme(name: str):
    """compressed-tensors' QuantizationScheme for one of the tested schemes: llm-compressor's
    presets (W8A8, FP8_DYNAMIC) as they are; W4A16 with group 32 (the preset's 128 would be
    one group per row here) and W8A16 per channel (the preset is grouped) as a user writes
    a custom scheme."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization import preset_name_to_scheme as preset

    if name == "w4a16_group32":
        args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32,
                                symmetric=True)  # fmt: skip
        return QuantizationScheme(targets=["Linear"], weights=args)
    if name == "w8a16_channel":
        args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
        return QuantizationScheme(targets=["Linear"], weights=args)
    if name == "fp8_tensor_dynamic":  # per-tensor FP8 weights, dynamic per-token FP8 acts
        s = preset("FP8_DYNAMIC", ["Linear"])
        return s.model_copy(update=dict(weights=s.weights.model_copy(update=dict(
            strategy="tensor"))))  # fmt: skip
    return preset({"w8a8_int8": "W8A8", "fp8_dynamic": "FP8_DYNAMIC"}[name], ["Linear"])


# scheme -> (config.json's format as compressed-tensors infers it, QuantizedWeight.act_quant)
EXPECT = {
    "w4a16_group32": ("pack-quantized", "none"),
    "w8a16_channel": ("pack-quantized", "none"),
    "w8a8_int8": ("int-quantized", "int8"),
    "fp8_dynamic": ("float-quantized", "fp8"),
    "fp8_tensor_dynamic": ("float-quantized", "fp8"),
}


def _write_compressed(directory, scheme_name: str) -> None:
    """A random tiny Llama quantized and saved by compressed-tensors (module docstring)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = make_tiny_hf_model("llama", seed=3, **SHAPE)
    config = QuantizationConfig(config_groups={"group_0": _scheme(scheme_name)},
                                ignore=["lm_head"])  # fmt: skip
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            w, args = module.weight, scheme.weights
            if args.strategy == "group":
                w = w.reshape(w.shape[0], -1, args.group_size)
            reduce = None if args.strategy == "tensor" else -1
            lo = w.amin() if reduce is None else w.amin(reduce)
            hi = w.amax() if reduce is None else w.amax(reduce)
            scale, zero = calculate_qparams(lo.reshape(-1, 1) if reduce is None else lo,
                                            hi.reshape(-1, 1) if reduce is None else hi,
                                            args)  # fmt: skip
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(directory))
    compressor.update_config(str(directory))


def _hf_model(directory):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, EOS off."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=0,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _hf_logprobs(model, seq: list[int]) -> np.ndarray:
    """float64 log-softmax [len(seq) - 1, V] of the teacher-forced seq (row r predicts
    seq[r + 1])."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _pj_run(llm: LLM, prompt: list[int], prompt_rows: bool) -> tuple[list[int], np.ndarray]:
    """pagedjax's greedy continuation and its log-probabilities over the whole vocabulary,
    rows as _hf_logprobs' on prompt + continuation: the generated tokens' (logprobs = V)
    and, with prompt_rows, the prompt's (prompt_logprobs = V); rows not asked for are NaN."""
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=VOCAB,
                        prompt_logprobs=VOCAB if prompt_rows else None)  # fmt: skip
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    rows = [*(out.prompt_logprobs[1:] if prompt_rows else [None] * (len(prompt) - 1)),
            *out.outputs[0].logprobs]  # fmt: skip
    dense = np.full((len(rows), VOCAB), np.nan)
    for r, entry in enumerate(rows):
        for tok, lp in (entry or {}).items():
            dense[r, tok] = lp.logprob
    assert not np.isnan(dense[len(prompt) - 1 :]).any()
    assert not prompt_rows or not np.isnan(dense).any()
    return list(out.outputs[0].token_ids), dense


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _kernel(params, role: str):
    node = params["layers"]
    for part in role.split("."):
        node = node[part]
    return node["kernel"]


def _assert_same_weights(hf, params) -> None:
    """Every linear's weight as transformers decompressed it (after a forward) equals
    pagedjax's dequantized QuantizedWeight bit for bit: both compute q * scale once in
    float32."""
    import jax

    dequantize_layers = jax.jit(jax.vmap(dequantize))  # one program per weight shape
    for role in LINEARS:
        ours = np.asarray(dequantize_layers(_kernel(params, role)))  # [layers, in, out]
        for i, layer in enumerate(hf.model.layers):
            theirs = layer.get_submodule(role).weight.detach().numpy().T
            np.testing.assert_array_equal(ours[i], theirs, err_msg=f"layer {i} {role}")


def _activation_rounding_effect(hf, seq: list[int], ref: np.ndarray) -> float:
    """max |ref - the same model's log-probabilities with activation rounding off|: how
    much the W8A8 activation quantization itself moves the output."""
    modules = [m for m in hf.modules() if hasattr(m, "quantization_scheme")]
    for m in modules:
        m.quantization_enabled = False
    try:
        return float(np.abs(ref - _hf_logprobs(hf, seq)).max())
    finally:
        for m in modules:
            m.quantization_enabled = True


def _agree(prompt, got, lp, hf_ids, ref, bound: float) -> None:
    """Log-probabilities within bound everywhere; the greedy tokens equal transformers',
    except where they part at a step whose top-2 gap in transformers is within twice that
    row's measured difference (a near-tie the difference can flip; the sequences part
    there, so the comparison of tokens ends)."""
    err = np.nan_to_num(np.abs(lp - ref), nan=0.0)  # NaN: a row pagedjax was not asked for
    assert err.max() <= bound, f"max |difference| {err.max():.3g} > {bound:.3g}"
    for i in range(N_NEW):
        if got[i] == hf_ids[i]:
            continue
        row = len(prompt) - 1 + i
        top2 = np.sort(ref[row])[-2:]
        assert top2[1] - top2[0] <= 2 * err[row].max(), (
            f"step {i}: {got} vs transformers {hf_ids}, not a near-tie")
        break


@contextlib.contextmanager
def _vllm_int8_activation_rule():
    """compressed-tensors' dynamic int8 per-token rule made vLLM's (scaled_int8_quant):
    scale = absmax / 127, codes in [-127, 127], instead of absmax / 127.5 in [-128, 127].
    Only dynamic int8 activations are affected (weights are not fake-quantized once
    decompressed)."""
    import torch
    from compressed_tensors.quantization.lifecycle import forward

    dynamic_scale, value_range = forward.compute_dynamic_scales_and_zp, forward.calculate_range

    def is_int8_dynamic(args) -> bool:
        return args.type == "int" and args.num_bits == 8 and bool(args.dynamic)

    def scale_rule(value, args, module, global_scale=None):
        if not is_int8_dynamic(args) or args.strategy != "token":
            return dynamic_scale(value, args, module, global_scale=global_scale)
        scale = value.abs().amax(-1, keepdim=True) / 127.0
        return scale, torch.zeros_like(scale)

    def range_rule(args, device):
        if not is_int8_dynamic(args):
            return value_range(args, device)
        return torch.tensor(-127.0, device=device), torch.tensor(127.0, device=device)

    forward.compute_dynamic_scales_and_zp, forward.calculate_range = scale_rule, range_rule
    try:
        yield
    finally:
        forward.compute_dynamic_scales_and_zp, forward.calculate_range = (
            dynamic_scale, value_range)  # fmt: skip


@pytest.mark.parametrize("scheme,prompt_rows,step_tokens", [
    # CI: one scheme per format, one engine geometry (16-token steps: the prompt runs in
    # chunks), the prompt rows for W4A16 only: each prompt_logprobs step is one more
    # compiled program. Slow: every scheme with its prompt rows and 48-token steps (the
    # 40-token prompt in one step, where a grouped weight takes the dequantize-then-dot
    # form of the matmul; decode steps take the grouped form).
    ("w4a16_group32", True, 16), ("w8a8_int8", False, 16), ("fp8_dynamic", False, 16),
    *(pytest.param(s, True, 48, marks=pytest.mark.slow) for s in EXPECT),
])  # fmt: skip
def test_compressed_tensors_agrees_with_transformers(tmp_path, scheme, prompt_rows, step_tokens):
    fmt, act_quant = EXPECT[scheme]
    _write_compressed(tmp_path, scheme)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == fmt  # compressed-tensors chose the format pagedjax reads
    hf = _hf_model(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=8, max_model_len=MAX_LEN,
              max_num_seqs=1, max_num_batched_tokens=step_tokens, num_gpu_blocks_override=10,
              max_logprobs=VOCAB, warmup="none", num_scheduler_steps=1)  # fmt: skip
    params = llm.llm_engine.params
    w = _kernel(params, "mlp.down_proj")  # found with no quantization flag
    assert isinstance(w, QuantizedWeight) and w.fmt == fmt and w.act_quant == act_quant
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, VOCAB, PROMPT_LEN)]
    got, lp = _pj_run(llm, prompt, prompt_rows)
    seq = prompt + got
    ref = _hf_logprobs(hf, seq)  # compressed-tensors' own forward
    _assert_same_weights(hf, params)  # decompressed by the forward above
    if act_quant == "none":
        _agree(prompt, got, lp, _hf_greedy(hf, prompt), ref, 1e-4 * np.abs(ref).max())
        return
    effect = _activation_rounding_effect(hf, seq, ref)
    if act_quant == "int8":  # compressed-tensors' grid: two independent roundings
        assert np.nanmax(np.abs(lp - ref)) <= 2 * effect
        with _vllm_int8_activation_rule():
            hf_ids, ref = _hf_greedy(hf, prompt), _hf_logprobs(hf, seq)
    else:
        hf_ids = _hf_greedy(hf, prompt)
    _agree(prompt, got, lp, hf_ids, ref, 0.5 * effect)
