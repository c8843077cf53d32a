"""Train an EAGLE-style draft head on a model's own greedy outputs (CPU, minutes).

    python -m pagedjax.engine.train_eagle [--model smollm2-135m-instruct] [--out DIR]
        [--prompts 64] [--gen-tokens 96] [--steps 2000] [--time-budget 240]
        [--batch 4] [--lr 1e-3] [--seed 0]

1. Data: the target answers ``--prompts`` chat prompts greedily (``LLM.generate``);
   the prompts are templated from a topic list (disjoint from the eval questions in
   pagedjax/eval/chat.py, which the benchmark measures on). Self-distillation: the
   head learns what the *target* says, which is what it must predict when serving.
2. Teacher forcing: one forward of the target per sequence gives its post-norm feature
   f_p at every position (``spec_eagle.forward_with_features``) and its greedy token.
3. Training (optax AdamW, gradient clipping): the head reads (f_p, x_{p+1}) and is
   trained as EAGLE-1: smooth-L1 of g_p against f_{p+1} plus 0.1 x cross-entropy of
   lm_head(g_p) against the target's greedy token after x_{p+1}. One eighth of the
   sequences are held out; the log prints their teacher-forced top-1 agreement (an
   upper bound on the first draft's acceptance; later drafts read the head's own g).
4. Saves config.json + model.safetensors into ``--out`` (default: the user's cache,
   ``~/.cache/pagedjax/eagle/<model>``; never committed), the run's numbers in
   config.json's ``train``. Use: ``{"method": "eagle", "model": OUT, ...}``.

optax is needed (``pip install optax``; the ``train`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import PAD_SLOT, ragged_paged_attention
from pagedjax.engine.spec_eagle import embed_tokens, forward_with_features, lm_logits
from pagedjax.model import ModelInput
from pagedjax.model.eagle import EagleConfig, EagleHead, init_head, save_head

TEMPLATES = (
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "What are three interesting facts about {}?",
    "Give me some practical advice about {}.",
)
TOPICS = (
    "volcanoes", "the history of Rome", "learning to cook", "machine learning", "gardening",
    "the moon", "saving money", "healthy sleep", "the Internet", "honey bees", "chess",
    "rainforests", "electric cars", "writing a resume", "the water cycle", "public speaking",
)  # fmt: skip
BLOCK = 16


def default_out(model: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pagedjax" / "eagle" / model


def training_prompts(count: int) -> list[str]:
    qs = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    return [qs[i % len(qs)] for i in range(count)]


def ragged_rows(num_rows: int, length: int) -> ModelInput:
    """num_rows rows of ``length`` tokens each (tokens unused), each row its own blocks
    1 + r * length / BLOCK ... of a pool with num_rows * length / BLOCK + 1 blocks."""
    t = jnp.arange(num_rows * length, dtype=jnp.int32)
    per = length // BLOCK
    return ModelInput(
        tokens=jnp.zeros_like(t), positions=t % length, slot_mapping=BLOCK + t,
        block_tables=1 + jnp.arange(num_rows * per, dtype=jnp.int32).reshape(num_rows, per),
        kv_lens=jnp.full((num_rows,), length, jnp.int32),
        cu_q_lens=jnp.arange(num_rows + 1, dtype=jnp.int32) * length,
        logits_indices=jnp.zeros((1,), jnp.int32),
    )  # fmt: skip


def dense_causal_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                           *, layer: Any, sm_scale: float, **_: Any) -> jax.Array:  # fmt: skip
    """The attention backends' signature for ``ragged_rows`` batches only (equal rows,
    each in its own consecutive blocks from block 1), written densely so it can be
    differentiated (the reference backend loops with a dynamic trip count)."""
    t, hq, d = q.shape
    rows = kv_lens.shape[0]
    kp, vp = k_pool[layer][1:], v_pool[layer][1:]  # [nb - 1, Hkv, B, D]
    hkv = kp.shape[1]
    k = jnp.repeat(kp.transpose(0, 2, 1, 3).reshape(-1, hkv, d)[:t], hq // hkv, axis=1)
    v = jnp.repeat(vp.transpose(0, 2, 1, 3).reshape(-1, hkv, d)[:t], hq // hkv, axis=1)
    scores = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32))
    i = jnp.arange(t)
    row = i // (t // rows)
    mask = (row[:, None] == row[None, :]) & (i[None, :] <= i[:, None])
    probs = jax.nn.softmax(jnp.where(mask, scores * sm_scale, -1e30), axis=-1)
    return jnp.einsum("hts,shd->thd", probs, v.astype(jnp.float32)).astype(q.dtype)


def pool(num_layers: int, num_blocks: int, heads: int, head_dim: int) -> tuple:
    shape = (num_layers, num_blocks, heads, BLOCK, head_dim)
    return (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


def teacher_features(arch: Any, params: Any, seqs: list[list[int]], length: int):
    """(F [N, length, H] post-norm features, Y [N, length] greedy tokens, X [N, length]
    ids, lengths [N]): one target forward per sequence, padded to ``length``."""
    inp0 = ragged_rows(1, length)

    @jax.jit  # params as an argument: closed over, they would be folded in as constants
    def one(params, ids, n):
        inp = inp0._replace(tokens=ids, slot_mapping=jnp.where(inp0.positions < n,
                                                                inp0.slot_mapping, PAD_SLOT))
        kv = pool(arch.num_layers, length // BLOCK + 1, arch.num_kv_heads, arch.head_dim)
        _, _, f = forward_with_features(params, kv, inp, arch=arch,
                                        attention_fn=ragged_paged_attention)  # fmt: skip
        y = jnp.argmax(lm_logits(params, arch, f), axis=-1).astype(jnp.int32)
        return f, y

    feats, ys, xs, ns = [], [], [], []
    for s in seqs:
        s = s[:length]
        ids = np.zeros(length, np.int32)
        ids[: len(s)] = s
        f, y = one(params, jnp.asarray(ids), jnp.int32(len(s)))
        feats.append(np.asarray(f))
        ys.append(np.asarray(y))
        xs.append(ids)
        ns.append(len(s))
    return np.stack(feats), np.stack(ys), np.stack(xs), np.asarray(ns, np.int32)


def make_loss(arch: Any, head_arch: Any, rows: int, length: int):
    module = EagleHead(head_arch, attention_fn=dense_causal_attention)
    inp = ragged_rows(rows, length)
    nb = rows * length // BLOCK + 1

    def loss_fn(hp, target_params, f, y, x, n):
        """f [R, Lm, H], y / x [R, Lm], n [R]: position p reads (f_p, x_{p+1}); targets
        f_{p+1} and y_{p+1}; valid for p + 2 < n (x_{p+1} and y_{p+1} real)."""
        kv = pool(1, nb, head_arch.num_kv_heads, head_arch.head_dim)
        nxt = jnp.concatenate([x[:, 1:], jnp.zeros((rows, 1), jnp.int32)], axis=1)
        emb = embed_tokens(target_params, arch, nxt.reshape(-1))
        _, g = module.apply({"params": hp}, kv, f.reshape(rows * length, -1), emb, inp)
        g = g.reshape(rows, length, -1)
        tf = jnp.concatenate([f[:, 1:], f[:, -1:]], axis=1)
        ty = jnp.concatenate([y[:, 1:], y[:, -1:]], axis=1)
        p = jnp.arange(length)[None, :]
        mask = (p + 2 < n[:, None]).astype(jnp.float32)
        denom = jnp.maximum(mask.sum(), 1.0)
        d = jnp.abs(g - tf)
        reg = jnp.where(d < 1.0, 0.5 * d * d, d - 0.5).mean(-1)
        logits = lm_logits(target_params, arch, g)
        lse = jax.nn.logsumexp(logits, axis=-1)
        ce = lse - jnp.take_along_axis(logits, ty[..., None], axis=-1)[..., 0]
        top1 = (jnp.argmax(logits, axis=-1) == ty).astype(jnp.float32)
        reg_l, ce_l = (reg * mask).sum() / denom, (ce * mask).sum() / denom
        return reg_l + 0.1 * ce_l, (reg_l, ce_l, (top1 * mask).sum() / denom)

    return loss_fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None, help="head directory (default: the user's cache)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=2000, help="at most this many steps")
    ap.add_argument("--time-budget", type=float, default=240.0, help="training seconds")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import optax  # the ``train`` extra

    from pagedjax.engine.llm import LLM
    from pagedjax.sampling import SamplingParams

    t0 = time.time()
    out = Path(args.out).expanduser() if args.out else default_out(args.model)
    data = out / f"data-{args.prompts}x{args.gen_tokens}.json"  # reused by a rerun
    seqs = json.loads(data.read_text()) if data.is_file() else None
    llm = LLM(model=args.model, warmup="none", max_num_seqs=max(args.prompts, 1),
              max_num_batched_tokens=2048, max_model_len=1024)
    engine = llm.llm_engine
    arch, params, tok = engine.arch, engine.params, llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in training_prompts(args.prompts)]  # fmt: skip
    if seqs is None:
        sp = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens)
        outs = llm.generate(texts, sp)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        out.mkdir(parents=True, exist_ok=True)
        data.write_text(json.dumps(seqs))
    length = -(-max(len(s) for s in seqs) // BLOCK) * BLOCK
    t_gen = time.time() - t0
    print(f"generated {len(seqs)} sequences (max {length} tokens) in {t_gen:.0f} s", flush=True)
    F, Y, X, N = teacher_features(arch, params, seqs, length)
    t_feat = time.time() - t0 - t_gen
    print(f"teacher-forced features in {t_feat:.0f} s", flush=True)

    cfg = EagleConfig.for_target(arch, target=args.model)
    hp = init_head(cfg, arch, seed=args.seed)
    head_arch = cfg.head_arch(arch)
    held = max(1, len(seqs) // 8)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(seqs))
    test_idx, train_idx = order[:held], order[held:]
    loss_fn = make_loss(arch, head_arch, args.batch, length)
    tp = {k: params[k] for k in ("embed_tokens", "lm_head") if k in params}
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(
                          0.0, args.lr, 20, max(args.steps, 21)), weight_decay=0.0))  # fmt: skip
    state = opt.init(hp)

    @jax.jit
    def train_step(hp, state, tp, f, y, x, n):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(hp, tp, f, y, x, n)
        upd, state = opt.update(grads, state, hp)
        return optax.apply_updates(hp, upd), state, loss, aux

    eval_fn = jax.jit(loss_fn)

    def evaluate(hp) -> float:
        tops = []
        for i in range(0, held - held % args.batch or held, args.batch):
            idx = test_idx[np.arange(i, i + args.batch) % held]
            tops.append(float(eval_fn(hp, tp, F[idx], Y[idx], X[idx], N[idx])[1][2]))
        return float(np.mean(tops))

    print(f"held-out top-1 before training: {evaluate(hp):.3f}", flush=True)
    t_train, step, loss = time.time(), 0, float("nan")
    while step < args.steps and time.time() - t_train < args.time_budget:
        idx = train_idx[rng.integers(0, len(train_idx), args.batch)]
        hp, state, loss, aux = train_step(hp, state, tp, F[idx], Y[idx], X[idx], N[idx])
        step += 1
        if step % 25 == 0 or step == 1:
            reg, ce, top1 = (float(a) for a in aux)
            print(f"step {step} loss {float(loss):.3f} reg {reg:.3f} ce {ce:.3f} top1 {top1:.3f}"
                  f" ({time.time() - t_train:.0f} s)", flush=True)  # fmt: skip
    secs = time.time() - t_train
    top1 = evaluate(hp)
    print(f"trained {step} steps in {secs:.0f} s; held-out teacher-forced top-1 {top1:.3f}")
    meta = dict(steps=step, train_seconds=round(secs, 1), total_seconds=round(time.time() - t0, 1),
                final_loss=round(float(loss), 4), heldout_top1=round(top1, 4),
                sequences=len(seqs), held_out=held, gen_tokens=args.gen_tokens,
                batch=args.batch, lr=args.lr, load=round(os.getloadavg()[0], 1))  # fmt: skip
    save_head(out, dataclasses_replace(cfg, train=meta), hp)
    print(f"saved {out} ({json.dumps(meta)})")
    return 0


def dataclasses_replace(cfg: EagleConfig, **kw: Any) -> EagleConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


if __name__ == "__main__":
    raise SystemExit(main())
