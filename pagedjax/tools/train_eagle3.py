"""Train an EAGLE-3 head on a model's own greedy outputs, with training-time test (CPU).

    python -m pagedjax.tools.train_eagle3 [--model smollm2-135m-instruct] [--out DIR]
        [--prompts 320] [--gen-tokens 128] [--gen-budget 900] [--draft-vocab 8192]
        [--ttt-steps 3] [--time-budget 300] [--batch-tokens 512] [--lr 2e-3] [--steps N]
        [--aux-layers 2 15 27] [--seed 0]

train_eagle.py's self-distillation pipeline, reused: the same templated questions
answered greedily by the target (the same data cache, ``~/.cache/pagedjax/eagle/data/``:
a head of either kind trains on answers already there), one teacher-forced prefill per
few sequences, the draft vocabulary (the most frequent answer ids), length buckets,
AdamW with warm-up and a cosine decay over ``--time-budget`` seconds, a tenth held out.
What is EAGLE-3's:

* **Features**: the target's residual stream entering three layers
  (``engine/spec/eagle3.forward_with_aux``; ``--aux-layers``, default vLLM's
  (2, L // 2, L - 3)), [T, 3H] per sequence, fused by the head's fc.
* **Training-time test** (``--ttt-steps`` n, default 3): the head is unrolled n draft
  steps as it drafts when serving. Step 0 reads (fused features F_p, x_{p+1}) at every
  position p and predicts x_{p+2}. Step j >= 1 at position t reads the head's own
  step j - 1 output at t - 1 (not the target's features: EAGLE-3's rule) and x_{t+1},
  predicts x_{t+2}, and attends to step 0's keys up to the chain's anchor t - j and to
  the keys its own chain wrote at steps 1 .. j (positions t - j + 1 .. t): exactly the
  keys the head sees when proposing draft j after a catch-up up to the anchor
  (``ttt_attention``; a test checks the unrolled outputs against the paged proposal
  chain). The tokens are the target's (teacher forcing): a draft after a rejected one
  is never verified, so only the chain of correct drafts matters.
* **Loss**: cross-entropy only (EAGLE-3 drops EAGLE-1's feature regression), over the
  draft vocabulary against the target's greedy token, summed over the steps with
  weights 0.8^j, on answer positions whose chain starts inside the answer.
* The features are cached (``~/.cache/pagedjax/eagle3/data/``, per length bucket,
  keyed by the answers' file and the layers: ~330 MB for 320 answers), so a rerun
  with other training flags starts training at once.
* Init: fc near [0; 0; I], the LM head = the target's rows for the draft vocabulary,
  the final norm = the target's.

Logs the held-out teacher-forced top-1 per unrolled step (a token outside the draft
vocabulary counts as a miss): step 0 bounds the first draft's acceptance, step j
the (j+1)-th draft's given the earlier ones were right. Saves into ``--out``
(default the user's cache, ``~/.cache/pagedjax/eagle3/<model>``; never committed).
Use: ``{"method": "eagle3", "model": OUT, "num_speculative_tokens": k}``. Needs optax.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.spec.eagle import embed_tokens
from pagedjax.engine.spec.eagle3 import forward_with_aux
from pagedjax.model.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    head_logits,
    init_head,
    module_params,
    save_head,
)
from pagedjax.tools.train_eagle import (
    BLOCK,
    LENGTHS,
    bucket_length,
    draft_vocabulary,
    generate_data,
    pool,
    ragged_rows,
    teacher_features,
    train_programs,
)
from pagedjax.tools.train_eagle import default_out as eagle_out

STEP_WEIGHT = 0.8  # step j's loss weight is 0.8^j (EAGLE-3's)


def default_out(model: str) -> Path:
    return eagle_out(model).parent.parent / "eagle3" / model


def ttt_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array,
                  kv_lens: jax.Array, cu_q_lens: jax.Array, *, layer: Any, sm_scale: float,
                  step: int, **_: Any) -> jax.Array:  # fmt: skip
    """Unrolled step ``step``'s attention on ``ragged_rows`` batches whose step i wrote
    its keys to pool segment i (slots BLOCK + i T + t, T = rows x length). Query t (row
    r, position p) sees step 0's keys at positions <= p - step of its row and, for
    i = 1 .. step, step i's key at t - (step - i) (its chain), when that is in its row.
    Dense, so it differentiates; the attention backends' signature."""
    t, hq, d = q.shape
    rows = kv_lens.shape[0]
    length = t // rows
    kp, vp = k_pool[layer][1:], v_pool[layer][1:]
    hkv = kp.shape[1]
    n = (step + 1) * t
    flat = lambda p: jnp.repeat(p.transpose(0, 2, 1, 3).reshape(-1, hkv, d)[:n], hq // hkv, 1)
    k, v = flat(kp), flat(vp)
    scores = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32))
    i = jnp.arange(t)
    pos, row = i % length, i // length
    s_all = jnp.arange(n)
    seg, s = s_all // t, s_all % t
    base = (seg[None, :] == 0) & (row[s][None, :] == row[:, None]) & (
        pos[s][None, :] <= pos[:, None] - step)
    back = step - seg[None, :]  # how far back the chain's step-seg key lies
    chain = (seg[None, :] >= 1) & (s[None, :] == i[:, None] - back) & (pos[:, None] >= back)
    mask = base | chain
    probs = jax.nn.softmax(jnp.where(mask, scores * sm_scale, -1e30), axis=-1)
    return jnp.einsum("hts,shd->thd", probs, v.astype(jnp.float32)).astype(q.dtype)


def ttt_outputs(head_arch: Any, arch: Any, rows: int, length: int, steps: int):
    """fn(hp, tp, f [R, Lm, 3H], x [R, Lm]) -> [g^0, ..., g^{steps-1}], each [R, Lm, H]:
    the head unrolled ``steps`` draft steps (module docstring), step j's query at
    position t reading g^{j-1} at t - 1 (zeros at a row's first position) and
    embed(x_{t+1}). tp: the target's params with at least ``embed_tokens``."""
    inp = ragged_rows(rows, length)
    t = rows * length
    nb = steps * t // BLOCK + 1
    mods = [Eagle3Head(head_arch, attention_fn=functools.partial(ttt_attention, step=j))
            for j in range(steps)]  # fmt: skip
    h = head_arch.hidden_size

    def fn(hp, tp, f, x):
        kv = pool(1, nb, head_arch.num_kv_heads, head_arch.head_dim)
        nxt = jnp.concatenate([x[:, 1:], jnp.zeros((rows, 1), jnp.int32)], axis=1)
        emb = embed_tokens(tp, arch, nxt.reshape(-1))
        hidden, outs = f.reshape(t, -1), []
        for j, mod in enumerate(mods):
            step_inp = inp._replace(slot_mapping=inp.slot_mapping + j * t)
            kv, g = mod.apply({"params": module_params(hp)}, kv, hidden, emb, step_inp)
            g = g.reshape(rows, length, h)
            outs.append(g)
            hidden = jnp.concatenate([jnp.zeros((rows, 1, h), g.dtype), g[:, :-1]],
                                     axis=1).reshape(t, h)  # fmt: skip
        return outs

    return fn


def make_loss(arch: Any, head_arch: Any, rows: int, length: int, steps: int):
    """loss_fn(hp, tp, f, x, n, start) -> (loss, (ce [steps], correct [steps],
    counted [steps])). f [R, Lm, 3H], x [R, Lm], n [R] lengths, start [R] the first
    anchor trained (prompt length - 2); tp: ``embed_tokens`` plus ``t2d`` int32[V] (an
    id's draft index, -1 outside). Step j at position t predicts x_{t+2} from a chain
    anchored at t - j; counted when t - j >= start and t + 2 < n."""
    forward = ttt_outputs(head_arch, arch, rows, length, steps)
    eps = head_arch.norm_eps

    def loss_fn(hp, tp, f, x, n, start):
        outs = forward(hp, tp, f, x)
        ty = jnp.concatenate([x[:, 2:], jnp.zeros((rows, 2), jnp.int32)], axis=1)
        tgt = tp["t2d"][ty]
        p = jnp.arange(length)[None, :]
        total, ces, hits, counts = 0.0, [], [], []
        for j, g in enumerate(outs):
            mask = (p + 2 < n[:, None]) & (p - j >= start[:, None])
            inside = mask & (tgt >= 0)
            logits = head_logits(hp, g, eps)
            lse = jax.nn.logsumexp(logits, axis=-1)
            ce = lse - jnp.take_along_axis(logits, jnp.maximum(tgt, 0)[..., None], -1)[..., 0]
            ce_l = jnp.where(inside, ce, 0.0).sum() / jnp.maximum(inside.sum(), 1)
            total = total + STEP_WEIGHT**j * ce_l
            ces.append(ce_l)
            hits.append(((jnp.argmax(logits, axis=-1) == tgt) & inside).sum())
            counts.append(mask.sum())
        return total, (jnp.stack(ces), jnp.stack(hits), jnp.stack(counts))

    return loss_fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None, help="head directory (default: the user's cache)")
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--gen-budget", type=float, default=900.0)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    ap.add_argument("--aux-layers", type=int, nargs=3, default=None,
                    help="target layer ids fused (vLLM's indexing; default (2, L//2, L-3))")
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--time-budget", type=float, default=300.0, help="training seconds")
    ap.add_argument("--batch-tokens", type=int, default=512, help="padded tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from pagedjax.config import ModelConfig
    from pagedjax.engine.loading import load_model

    t0 = time.time()
    out = Path(args.out).expanduser() if args.out else default_out(args.model)
    name = f"{args.model}-{args.prompts}x{args.gen_tokens}-s{args.seed}.json"
    data = generate_data(args.model, args.prompts, args.gen_tokens, args.seed,
                         eagle_out(args.model).parent / "data" / name, args.gen_budget)  # fmt: skip
    seqs, plens = data["seqs"], data["prompt_lens"]
    ntok = sum(len(s) - p for s, p in zip(seqs, plens, strict=True))
    print(f"{len(seqs)} sequences, {ntok} answer tokens ({time.time() - t0:.0f} s)", flush=True)
    arch, params, _, _ = load_model(ModelConfig(model=args.model))
    cfg = Eagle3Config.for_target(arch, target=args.model, aux_layers=args.aux_layers)
    head_arch = cfg.head_arch(arch)  # checks the aux layers

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(seqs))
    held = max(1, len(seqs) // 10)
    test_set = set(order[:held].tolist())
    vocab = draft_vocabulary([seqs[i][plens[i]:] for i in order[held:]], args.draft_vocab,
                             arch.vocab_size)  # fmt: skip
    t2d = np.full(arch.vocab_size, -1, np.int32)
    t2d[vocab] = np.arange(len(vocab), dtype=np.int32)
    tp = {"embed_tokens": params["embed_tokens"], "t2d": jnp.asarray(t2d)}
    fwd = functools.partial(forward_with_aux, layers=cfg.aux_layers)
    feature_dir = default_out(args.model).parent / "data"
    buckets = {}
    for length in LENGTHS:
        idx = [i for i in range(len(seqs)) if bucket_length(len(seqs[i])) == length]
        if not idx:
            continue
        rows = max(1, args.batch_tokens // length)
        # The features are the slow stage on a CPU (one prefill of the whole data set):
        # cached beside the answers, keyed by the data file, the layers and the bucket.
        layers = "-".join(str(i) for i in cfg.aux_layers)
        cached = feature_dir / f"{Path(name).stem}-aux{layers}-len{length}.npy"
        if cached.is_file() and np.load(cached, mmap_mode="r").shape[0] == len(idx):
            f = np.load(cached)
        else:
            f = teacher_features(arch, params, [seqs[i] for i in idx], length, rows, fwd)
            feature_dir.mkdir(parents=True, exist_ok=True)
            np.save(cached, f)
        x = np.zeros((len(idx), length), np.int32)
        for j, i in enumerate(idx):
            x[j, : min(len(seqs[i]), length)] = seqs[i][:length]
        n = np.asarray([min(len(seqs[i]), length) for i in idx], np.int32)
        st = np.asarray([max(plens[i] - 2, 0) for i in idx], np.int32)
        test = np.asarray([i in test_set for i in idx])
        buckets[length] = dict(rows=rows, f=f, x=x, n=n, start=st,
                               train=np.flatnonzero(~test), test=np.flatnonzero(test))  # fmt: skip
    print(f"teacher-forced features (layers {list(cfg.aux_layers)}) at {time.time() - t0:.0f} s;"
          f" draft vocabulary {len(vocab)}", flush=True)  # fmt: skip

    full = len(vocab) == arch.vocab_size
    cfg = dataclasses.replace(cfg, draft_vocab_size=0 if full else len(vocab))
    hp = init_head(cfg, arch, seed=args.seed)
    w = (params["embed_tokens"]["embedding"] if arch.tie_word_embeddings
         else params["lm_head"]["kernel"].T)  # fmt: skip
    hp["lm_head"]["kernel"] = jnp.asarray(np.asarray(w, np.float32)[vocab].T)
    hp["norm"]["weight"] = jnp.asarray(params["norm"]["weight"], jnp.float32)
    opt, state, fns = train_programs(
        hp, args.lr, {n: make_loss(arch, head_arch, b["rows"], n, args.ttt_steps)
                      for n, b in buckets.items()},
    )  # fmt: skip

    def pick(b: dict, idx: np.ndarray) -> tuple:
        return b["f"][idx], b["x"][idx], b["n"][idx], b["start"][idx]

    def evaluate(hp) -> list[float]:
        """Held-out teacher-forced top-1 per unrolled step."""
        hits = counted = 0
        for length, b in buckets.items():
            t, rows = b["test"], b["rows"]
            for i in range(0, len(t), rows):
                real = t[i : i + rows]
                idx = np.concatenate([real, np.repeat(real[:1], rows - len(real))])
                nn_ = b["n"][idx].copy()
                nn_[len(real) :] = 0  # padding rows count nothing
                f, x, _, st = pick(b, idx)
                aux = fns[length][1](hp, tp, f, x, jnp.asarray(nn_), st)[1]
                hits, counted = hits + np.asarray(aux[1]), counted + np.asarray(aux[2])
        return [round(float(h) / max(float(c), 1.0), 4) for h, c in zip(hits, counted, strict=True)]

    print(f"held-out top-1 per step before training: {evaluate(hp)}", flush=True)
    lengths = list(buckets)
    weights = np.asarray([len(buckets[k]["train"]) * k for k in lengths], np.float64)
    t_train, step, loss = time.time(), 0, float("nan")
    while step < args.steps:
        frac = (time.time() - t_train) / args.time_budget
        if frac >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1.0 + np.cos(np.pi * frac))
        state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        length = lengths[rng.choice(len(lengths), p=weights / weights.sum())]
        b = buckets[length]
        idx = b["train"][rng.integers(0, len(b["train"]), b["rows"])]
        hp, state, loss, aux = fns[length][0](hp, state, tp, *pick(b, idx))
        step += 1
        if step % 25 == 0 or step == 1:
            top1 = np.asarray(aux[1]) / np.maximum(np.asarray(aux[2]), 1)
            print(f"step {step} loss {float(loss):.3f} ce {np.round(np.asarray(aux[0]), 3)}"
                  f" top1 {np.round(top1, 3)} lr {lr:.1e} ({time.time() - t_train:.0f} s)",
                  flush=True)  # fmt: skip
    secs = time.time() - t_train
    top1 = evaluate(hp)
    print(f"trained {step} steps in {secs:.0f} s; held-out teacher-forced top-1 per step {top1}")
    meta = dict(steps=step, train_seconds=round(secs, 1), total_seconds=round(time.time() - t0, 1),
                final_loss=round(float(loss), 4), heldout_top1_per_step=top1,
                ttt_steps=args.ttt_steps, sequences=len(seqs), held_out=held,
                answer_tokens=ntok, draft_vocab=len(vocab), batch_tokens=args.batch_tokens,
                lr=args.lr, load=round(os.getloadavg()[0], 1))  # fmt: skip
    save_head(out, dataclasses.replace(cfg, train=meta), hp, draft_vocab=None if full else vocab)
    print(f"saved {out} ({json.dumps(meta)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
