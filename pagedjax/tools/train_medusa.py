"""Train Medusa heads on a model's own greedy outputs (self-distillation, as train_eagle).

    python -m pagedjax.tools.train_medusa [--model smollm2-135m-instruct] [--out DIR]
        [--num-heads 3] [--num-layers 1] [--prompts 320] [--gen-tokens 128]
        [--gen-budget 900] [--time-budget 300] [--batch 512] [--lr 1e-3] [--seed 0]

The pipeline is ``train_eagle``'s, reused: (1) the target answers templated chat
questions greedily (``train_eagle.generate_data``, cached in the same data directory,
so heads and an EAGLE head can share one generation run); (2) one teacher-forced prefill
per few sequences gives the target's post-norm feature f_p at every position
(``train_eagle.teacher_features``). Medusa heads have no attention, so each position is
an independent example (``position_examples``): f_p with targets x_{p+2+i} for head i
(the target's own greedy tokens), for p from the last prompt position on. (3) Training
(``train_heads``, optax Adam): the loss is sum_i 0.8^i x cross-entropy of head i
against its target (Medusa-1's decaying weights), heads initialised with w = 0 (each
block starts as the identity) and every vocabulary projection = the target's LM head,
so an untrained head i proposes what the target would say next, which is Medusa's own
initialisation. A tenth of the sequences are held out: the log prints each head's
teacher-forced top-1 agreement on them (head 0's is an upper bound on the first
draft's acceptance). (4) Saves the heads (``model/medusa.py``, pagedjax's layout) into
``--out`` (default ``~/.cache/pagedjax/medusa/<model>``; never committed). Use:
``{"method": "medusa", "model": OUT, "num_speculative_tokens": k}``.

optax is needed (``pip install optax``; the ``train`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.medusa import MedusaConfig, init_heads, medusa_logits, save_heads
from pagedjax.tools.train_eagle import LENGTHS, bucket_length, generate_data, teacher_features

DECAY = 0.8  # Medusa-1's per-head loss weight lambda_i = DECAY ** i


def default_out(model: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pagedjax" / "medusa" / model


def target_lm_head(arch: Any, params: Any) -> np.ndarray:
    """The target's LM head as [H, V] float32 (tied: the embedding transposed)."""
    if arch.tie_word_embeddings:
        return np.asarray(params["embed_tokens"]["embedding"], np.float32).T
    return np.asarray(params["lm_head"]["kernel"], np.float32)


def position_examples(
    features: np.ndarray, seqs: Sequence[Sequence[int]], starts: Sequence[int], num_heads: int
) -> tuple[np.ndarray, np.ndarray]:
    """(X float32[M, H], Y int32[M, N]): one example per position p >= starts[s] of each
    sequence with at least head 0's target: X = features[s, p], Y[:, i] = x_{p+2+i}
    (-1 past the sequence's end). features [S, Lm, H] (``teacher_features``; positions
    past Lm are dropped); starts: the first position to train, the last prompt
    position (len(prompt) - 1): proposals are made from f_{L-2}, L - 1 >= prompt."""
    xs, ys = [], []
    lm = features.shape[1]
    for s, ids in enumerate(seqs):
        ids = np.asarray(ids[:lm], np.int64)
        n = len(ids)
        p = np.arange(max(int(starts[s]), 0), n - 2)
        if not p.size:
            continue
        t = p[:, None] + 2 + np.arange(num_heads)[None, :]
        ys.append(np.where(t < n, ids[np.minimum(t, n - 1)], -1).astype(np.int32))
        xs.append(features[s, p])
    h = features.shape[-1]
    if not xs:
        return np.zeros((0, h), np.float32), np.zeros((0, num_heads), np.int32)
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys)


def medusa_loss(hp: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, tuple]:
    """(loss, (ce [N], correct [N], counted [N])) on examples x [B, H], y int32[B, N]
    (-1: no target): sum_i DECAY^i x head i's mean cross-entropy."""
    logits = medusa_logits(hp, x)  # [B, N, V]
    valid = y >= 0
    lse = jax.nn.logsumexp(logits, axis=-1)
    pick = jnp.take_along_axis(logits, jnp.maximum(y, 0)[..., None], axis=-1)[..., 0]
    counted = valid.sum(0)
    ce = jnp.where(valid, lse - pick, 0.0).sum(0) / jnp.maximum(counted, 1)
    correct = ((jnp.argmax(logits, axis=-1) == y) & valid).sum(0)
    weights = DECAY ** jnp.arange(y.shape[1], dtype=jnp.float32)
    return (weights * ce).sum(), (ce, correct, counted)


def top1(hp: Any, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> np.ndarray:
    """Teacher-forced top-1 agreement per head, float[N], on examples (x, y)."""
    correct = np.zeros(y.shape[1])
    counted = np.zeros(y.shape[1])
    fn = jax.jit(lambda hp, x, y: medusa_loss(hp, x, y)[1])
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch], y[i : i + batch]
        pad = batch - len(xb)  # one shape: one compilation
        xb = np.concatenate([xb, np.zeros((pad, x.shape[1]), x.dtype)])
        yb = np.concatenate([yb, np.full((pad, y.shape[1]), -1, y.dtype)])
        _, c, n = fn(hp, jnp.asarray(xb), jnp.asarray(yb))
        correct, counted = correct + np.asarray(c), counted + np.asarray(n)
    return correct / np.maximum(counted, 1)


def train_heads(
    cfg: MedusaConfig, x: np.ndarray, y: np.ndarray, *, lm_head: np.ndarray, steps: int = 200,
    batch: int = 512, lr: float = 1e-3, seed: int = 0, time_budget: float | None = None,
    log_every: int = 0,
) -> tuple[Any, dict]:
    """Heads trained on examples (x float32[M, H], y int32[M, N]) with Adam (gradient
    clipping at 1, cosine decay over ``steps``), from w = 0 and every vocabulary
    projection = ``lm_head`` [H, V]. Returns (params, {"steps", "loss", "seconds"})."""
    import optax  # the ``train`` extra

    hp = init_heads(cfg, seed=seed, lm_head=lm_head)
    hp["w"] = jnp.zeros_like(hp["w"])  # identity blocks: head i starts as the target's head
    sched = optax.cosine_decay_schedule(lr, max(steps, 1))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))
    state = opt.init(hp)

    @jax.jit
    def step(hp, state, xb, yb):
        (loss, _), grads = jax.value_and_grad(medusa_loss, has_aux=True)(hp, xb, yb)
        upd, state = opt.update(grads, state, hp)
        return optax.apply_updates(hp, upd), state, loss

    rng = np.random.default_rng(seed)
    t0, loss, done = time.time(), float("nan"), 0
    for done in range(1, steps + 1):  # noqa: B007 (``done`` is reported)
        idx = rng.integers(0, len(x), min(batch, len(x)))
        hp, state, loss = step(hp, state, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
        if log_every and (done % log_every == 0 or done == 1):
            print(f"step {done} loss {float(loss):.3f} ({time.time() - t0:.0f} s)", flush=True)
        if time_budget is not None and time.time() - t0 > time_budget:
            break
    return hp, dict(steps=done, loss=round(float(loss), 4), seconds=round(time.time() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None, help="head directory (default: the user's cache)")
    ap.add_argument("--num-heads", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--gen-budget", type=float, default=900.0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--time-budget", type=float, default=300.0, help="training seconds")
    ap.add_argument("--batch", type=int, default=512, help="positions per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from pagedjax.config import ModelConfig
    from pagedjax.engine.loading import load_model
    from pagedjax.tools.train_eagle import default_out as eagle_out

    t0 = time.time()
    out = Path(args.out).expanduser() if args.out else default_out(args.model)
    name = f"{args.model}-{args.prompts}x{args.gen_tokens}-s{args.seed}.json"
    data = generate_data(args.model, args.prompts, args.gen_tokens, args.seed,
                         eagle_out(args.model).parent / "data" / name, args.gen_budget)  # fmt: skip
    seqs, plens = data["seqs"], data["prompt_lens"]
    arch, params, _, _ = load_model(ModelConfig(model=args.model))
    rng = np.random.default_rng(args.seed)
    held = set(rng.permutation(len(seqs))[: max(1, len(seqs) // 10)].tolist())
    parts: dict[bool, list] = {True: [], False: []}
    for length in LENGTHS:
        idx = [i for i in range(len(seqs)) if bucket_length(len(seqs[i])) == length]
        if not idx:
            continue
        f = teacher_features(arch, params, [seqs[i] for i in idx], length,
                             rows=max(1, 1024 // length))  # fmt: skip
        for j, i in enumerate(idx):
            ex = position_examples(f[j : j + 1], [seqs[i]], [plens[i] - 1], args.num_heads)
            parts[i in held].append(ex)
    x, y = (np.concatenate(a) for a in zip(*parts[False], strict=True))
    hx, hy = (np.concatenate(a) for a in zip(*parts[True], strict=True))
    print(f"{len(x)} training / {len(hx)} held-out positions ({time.time() - t0:.0f} s)")
    cfg = MedusaConfig.for_target(arch, args.num_heads, args.num_layers, target=args.model)
    lm = target_lm_head(arch, params)
    before = top1(init_heads(cfg, lm_head=lm) | {"w": jnp.zeros(
        (args.num_heads, args.num_layers, arch.hidden_size, arch.hidden_size))}, hx, hy)
    hp, meta = train_heads(cfg, x, y, lm_head=lm, steps=args.steps, batch=args.batch,
                           lr=args.lr, seed=args.seed, time_budget=args.time_budget,
                           log_every=50)  # fmt: skip
    after = top1(hp, hx, hy)
    print(f"held-out teacher-forced top-1 per head: before {np.round(before, 3).tolist()}"
          f" after {np.round(after, 3).tolist()}")  # fmt: skip
    meta |= dict(heldout_top1=[round(float(v), 4) for v in after], positions=len(x),
                 sequences=len(seqs), batch=args.batch, lr=args.lr)  # fmt: skip
    save_heads(out, dataclasses.replace(cfg, train=meta), hp)
    print(f"saved {out} ({json.dumps(meta)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
