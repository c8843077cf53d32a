"""Train an EAGLE-style draft head on a model's own greedy outputs (CPU, minutes).

    python -m pagedjax.tools.train_eagle [--model smollm2-135m-instruct] [--out DIR]
        [--prompts 320] [--gen-tokens 128] [--gen-budget 900] [--draft-vocab 8192]
        [--time-budget 300]
        [--batch-tokens 1024] [--lr 2e-3] [--ce-weight 0.1] [--steps N] [--seed 0]

1. Data (self-distillation: the head learns what the *target* says, which is what it
   must predict when serving): the target answers ``--prompts`` distinct chat questions
   greedily, all submitted at once to ``LLM.generate`` (batched: hundreds of tokens/s
   on a CPU where one request gets tens). The questions are templated
   (``PROMPT_KINDS`` x topics / words / numbers: facts, arithmetic, translation, code,
   advice, poems, ...); none is one of the 20 eval questions the benchmark measures on
   (pagedjax/eval/chat.py; tests check it), though the kinds overlap. Saved after
   every 64 answers in ``~/.cache/pagedjax/eagle/data/`` (a rerun with the same sizes
   and seed continues it); ``--gen-budget`` seconds cap this stage.
2. Teacher forcing: one prefill forward of the target over prompt + answer, several
   sequences per forward, gives its post-norm feature f_p at every position
   (``spec_eagle.forward_with_features``): thousands of training positions for the
   cost of a few decode steps each.
3. Draft vocabulary (FR-Spec / EAGLE-3's d2t; model/eagle.py): the ``--draft-vocab``
   ids most frequent in the training answers; the head drafts over those rows of the
   LM head only (0 = the full vocabulary).
4. Training (optax AdamW, gradient clipping, 20-step warm-up then a cosine decay over
   ``--time-budget`` seconds): the head reads (f_p, x_{p+1}) and is trained as
   EAGLE-1 on the answer's positions: smooth-L1 of g_p against f_{p+1} plus
   ``--ce-weight`` x cross-entropy of g_p's draft-vocabulary logits against x_{p+2}
   (the target's greedy token). Sequences train in length buckets (``LENGTHS``;
   ``--batch-tokens`` padded tokens per step). A tenth of the sequences are held out;
   the log prints their teacher-forced top-1 agreement on answer positions (a token
   outside the draft vocabulary counts as a miss): an upper bound on the first
   draft's acceptance (later drafts read the head's own g).
5. Saves config.json + model.safetensors (with ``draft_vocab``) into ``--out``
   (default: the user's cache, ``~/.cache/pagedjax/eagle/<model>``; never committed),
   the run's numbers in config.json's ``train``. Use:
   ``{"method": "eagle", "model": OUT, "num_speculative_tokens": k}``.

optax is needed (``pip install optax``; the ``train`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import PAD_SLOT, ragged_paged_attention
from pagedjax.engine.spec.eagle import embed_tokens, forward_with_features
from pagedjax.model import ModelInput
from pagedjax.model.eagle import EagleConfig, EagleHead, init_head, save_head

TOPICS = (
    "volcanoes", "the history of Rome", "learning to cook", "machine learning", "gardening",
    "the moon", "saving money", "healthy sleep", "the Internet", "honey bees", "chess",
    "rainforests", "electric cars", "writing a resume", "the water cycle", "public speaking",
    "black holes", "the Great Wall of China", "dinosaurs", "coffee", "the human heart",
    "earthquakes", "recycling", "the piano", "penguins", "the printing press", "glaciers",
    "solar panels", "the Olympic Games", "vaccines", "bread baking", "deserts", "octopuses",
    "the stock market", "meditation", "airplanes", "the French Revolution", "coral reefs",
    "cloud computing", "friendship", "tea", "the Amazon river", "time management",
    "electricity", "ancient Egypt", "wolves", "jazz music", "climate change", "bicycles",
    "the immune system", "mountains", "social media", "the Renaissance", "photography",
    "rain", "robots", "Mars", "football", "libraries", "the ocean tides",
)  # fmt: skip
PROMPT_KINDS = (
    ("Explain {} in simple terms.", "topic"), ("Write a short paragraph about {}.", "topic"),
    ("What are three interesting facts about {}?", "topic"),
    ("Give me some practical advice about {}.", "topic"),
    ("Explain {} in one sentence.", "topic"), ("Write a haiku about {}.", "topic"),
    ("Write a short poem about {}.", "topic"), ("Tell me a fun fact about {}.", "topic"),
    ("What makes {} interesting?", "topic"),
    ("Summarize what you know about {} in two sentences.", "topic"),
    ("What is {} plus {}?", "pair"), ("What is {} times {}?", "pair"),
    ("What is {} minus {}?", "pair"), ("What is {} divided by {}?", "pair"),
    ("What is the square root of {}?", "square"),
    ("What is the capital of {}?", "country"), ("Name a famous dish from {}.", "country"),
    ("Translate '{}' into {}.", "phrase"), ("Give me a synonym for '{}'.", "word"),
    ("What is the opposite of '{}'?", "word"), ("Use the word '{}' in a sentence.", "word"),
    ("Write a Python function that {}.", "code"), ("How do I {}?", "howto"),
    ("Name three {}.", "category"), ("List two {}.", "category"),
    ("What does {} stand for?", "acronym"), ("Suggest a name for a {}.", "pet"),
    ("Who wrote {}?", "book"), ("Finish the sentence: {}...", "saying"),
    ("How many {} are there in a {}?", "units"),
)  # fmt: skip
SLOTS = {
    "country": ("Japan", "Italy", "Canada", "Brazil", "Egypt", "India", "Kenya", "Norway",
                "Mexico", "Australia", "Germany", "Peru", "Spain", "Thailand", "Greece"),
    "phrase": ("thank you", "good night", "where is the library", "I am hungry", "see you tomorrow",
               "how are you", "happy birthday", "the cat is sleeping", "I love music", "excuse me"),
    "lang": ("French", "German", "Italian", "Portuguese", "Japanese"),
    "word": ("big", "fast", "bright", "quiet", "brave", "cold", "strong", "early", "smart",
             "difficult", "beautiful", "angry", "tiny", "rich", "simple", "heavy"),
    "code": ("reverses a string", "checks whether a number is prime", "sums a list of numbers",
             "returns the largest element of a list", "counts the vowels in a word",
             "computes the factorial of n", "converts Celsius to Fahrenheit",
             "removes duplicates from a list", "checks whether a word is a palindrome",
             "returns the n-th Fibonacci number", "sorts a list of names", "adds two numbers"),
    "howto": ("make a cup of tea", "tie a tie", "plant a tree", "change a flat tire",
              "write a good email", "learn a new language", "make pancakes", "stay focused",
              "start running", "clean a laptop keyboard", "bake cookies", "make new friends"),
    "category": ("fruits", "mammals", "programming languages", "musical instruments", "planets",
                 "European countries", "types of clouds", "vegetables", "famous painters",
                 "renewable energy sources", "benefits of reading", "uses of a computer"),
    "acronym": ("NASA", "HTML", "GPS", "RAM", "DNA", "USB", "UN", "Wi-Fi", "PDF", "URL"),
    "pet": ("pet cat", "pet dog", "pet parrot", "pet turtle", "pet rabbit", "pet hamster"),
    "book": ("Pride and Prejudice", "Hamlet", "1984", "The Odyssey", "Don Quixote",
             "Moby Dick", "War and Peace", "The Hobbit", "Macbeth", "Oliver Twist"),
    "saying": ("A penny saved", "Actions speak", "Practice makes", "Better late",
               "When in Rome", "All that glitters", "Two heads are", "Rome was not built"),
    "units": (("hours", "day"), ("minutes", "hour"), ("seconds", "minute"), ("months", "year"),
              ("weeks", "year"), ("centimeters", "meter"), ("grams", "kilogram")),
}  # fmt: skip


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct chat questions drawn from ``PROMPT_KINDS`` x slots (seeded).
    None is one of the benchmark's 20 eval questions (pagedjax/eval/chat.py; a test
    checks it): the kinds of question overlap, the questions do not."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < count:
        tpl, kind = PROMPT_KINDS[rng.integers(len(PROMPT_KINDS))]
        if kind == "topic":
            q = tpl.format(TOPICS[rng.integers(len(TOPICS))])
        elif kind == "pair":
            q = tpl.format(int(rng.integers(2, 100)), int(rng.integers(2, 20)))
        elif kind == "square":
            q = tpl.format(int(rng.integers(2, 30)) ** 2)
        elif kind == "phrase":
            q = tpl.format(SLOTS["phrase"][rng.integers(10)], SLOTS["lang"][rng.integers(5)])
        elif kind == "units":
            q = tpl.format(*SLOTS["units"][rng.integers(len(SLOTS["units"]))])
        else:
            q = tpl.format(SLOTS[kind][rng.integers(len(SLOTS[kind]))])
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


BLOCK = 16
LENGTHS = (64, 128, 160, 256)  # training length buckets (rows per step: batch tokens / length)


def default_out(model: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pagedjax" / "eagle" / model


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


def bucket_length(n: int) -> int:
    """The padded length a sequence of n tokens trains at (longer ones are cut)."""
    return next((length for length in LENGTHS if n <= length), LENGTHS[-1])


def teacher_features(arch: Any, params: Any, seqs: list[list[int]], length: int,
                     rows: int, forward_fn: Any = None) -> np.ndarray:  # fmt: skip
    """F [N, length, W] float32: the target's post-norm features (W = H) of every
    position of each sequence (cut / zero-padded to ``length``), ``rows`` sequences per
    forward (a prefill: no LM head beyond one row). forward_fn: another forward with
    ``forward_with_features``' signature and returns, e.g. EAGLE-3's fused layers
    (train_eagle3.py: W = 3H)."""
    forward_fn = forward_with_features if forward_fn is None else forward_fn
    inp0 = ragged_rows(rows, length)
    row_of = jnp.arange(rows * length, dtype=jnp.int32) // length

    @jax.jit  # params as an argument: closed over, they would be folded in as constants
    def forward(params, ids, n):
        real = inp0.positions < n[row_of]
        inp = inp0._replace(tokens=ids, slot_mapping=jnp.where(real, inp0.slot_mapping, PAD_SLOT))
        kv = pool(arch.num_layers, rows * length // BLOCK + 1, arch.num_kv_heads, arch.head_dim)
        _, _, f = forward_fn(params, kv, inp, arch=arch, attention_fn=ragged_paged_attention)
        return f

    out = None
    for i in range(0, len(seqs), rows):
        ids, n = np.zeros((rows, length), np.int32), np.zeros(rows, np.int32)
        for r, s in enumerate(seqs[i : i + rows]):
            s = s[:length]
            ids[r, : len(s)], n[r] = s, len(s)
        f = np.asarray(forward(params, jnp.asarray(ids.reshape(-1)), jnp.asarray(n)))
        if out is None:
            out = np.zeros((len(seqs), length, f.shape[-1]), np.float32)
        got = min(rows, len(seqs) - i)
        out[i : i + got] = f.reshape(rows, length, -1)[:got]
    return out


def draft_vocabulary(answers: list[list[int]], size: int, vocab_size: int) -> np.ndarray:
    """int32[<= size], ascending: the ``size`` most frequent ids of the answers (ties
    by id); every id when size is 0 or at least the vocabulary."""
    if size <= 0 or size >= vocab_size:
        return np.arange(vocab_size, dtype=np.int32)
    counts = np.bincount(np.concatenate([np.asarray(a, np.int64) for a in answers]),
                         minlength=vocab_size)  # fmt: skip
    seen = int((counts > 0).sum())
    top = np.argsort(-counts, kind="stable")[: min(size, seen)]
    return np.sort(top).astype(np.int32)


def make_loss(arch: Any, head_arch: Any, rows: int, length: int, ce_weight: float):
    """loss_fn(hp, tp, f, x, n, start) -> (loss, (reg, ce, correct, counted)).

    f [R, Lm, H] features, x [R, Lm] ids, n [R] lengths, start [R] the first position
    trained (prompt length - 2: the answer's positions); tp: the target's embedding
    plus ``lm`` [Nd, H] (the LM head's rows for the draft vocabulary) and ``t2d``
    int32[V] (an id's index in it, -1 outside). Position p reads (f_p, x_{p+1}) and
    is trained towards f_{p+1} (smooth L1) and x_{p+2} (cross-entropy over the draft
    vocabulary; a target outside it counts as a miss and adds no CE)."""
    module = EagleHead(head_arch, attention_fn=dense_causal_attention)
    inp = ragged_rows(rows, length)
    nb = rows * length // BLOCK + 1

    def loss_fn(hp, tp, f, x, n, start):
        kv = pool(1, nb, head_arch.num_kv_heads, head_arch.head_dim)
        nxt = jnp.concatenate([x[:, 1:], jnp.zeros((rows, 1), jnp.int32)], axis=1)
        emb = embed_tokens(tp, arch, nxt.reshape(-1))
        _, g = module.apply({"params": hp}, kv, f.reshape(rows * length, -1), emb, inp)
        g = g.reshape(rows, length, -1)
        tf = jnp.concatenate([f[:, 1:], f[:, -1:]], axis=1)
        ty = jnp.concatenate([x[:, 2:], jnp.zeros((rows, 2), jnp.int32)], axis=1)
        p = jnp.arange(length)[None, :]
        mask = (p + 2 < n[:, None]) & (p >= start[:, None])
        counted = jnp.maximum(mask.sum(), 1).astype(jnp.float32)
        d = jnp.abs(g - tf)
        reg = jnp.where(d < 1.0, 0.5 * d * d, d - 0.5).mean(-1)
        logits = jnp.einsum("rlh,nh->rln", g, tp["lm"]).astype(jnp.float32)
        tgt = tp["t2d"][ty]
        inside = mask & (tgt >= 0)
        lse = jax.nn.logsumexp(logits, axis=-1)
        ce = lse - jnp.take_along_axis(logits, jnp.maximum(tgt, 0)[..., None], axis=-1)[..., 0]
        correct = ((jnp.argmax(logits, axis=-1) == tgt) & inside).sum()
        reg_l = jnp.where(mask, reg, 0.0).sum() / counted
        ce_l = jnp.where(inside, ce, 0.0).sum() / jnp.maximum(inside.sum(), 1)
        return reg_l + ce_weight * ce_l, (reg_l, ce_l, correct, mask.sum())

    return loss_fn


def render(tok: Any, question: str) -> str:
    """The question as the model's chat prompt; as is for a tokenizer without a chat
    template (the byte tokenizer of the tiny presets: tests run the pipeline on them)."""
    if not hasattr(tok, "apply_chat_template"):
        return question
    return tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True)  # fmt: skip


def generate_data(model: str, count: int, gen_tokens: int, seed: int, path: Path,
                  budget_s: float, chunk: int = 64) -> dict:  # fmt: skip
    """{"prompt_lens": [...], "seqs": [prompt + greedy answer ids]}: the target answers
    templated questions greedily, ``chunk`` at a time in one batch, until ``count`` are
    answered or ``budget_s`` seconds have passed (then fewer: a shared CPU can be
    slow). Saved to ``path`` after every chunk; a rerun continues from it."""
    data = json.loads(path.read_text()) if path.is_file() else dict(prompt_lens=[], seqs=[])
    if len(data["seqs"]) >= count:
        return data
    from pagedjax.entrypoints.llm import LLM
    from pagedjax.sampling import SamplingParams

    t0 = time.time()
    llm = LLM(model=model, warmup="none", max_num_seqs=chunk, max_num_batched_tokens=2048,
              max_model_len=1024)  # fmt: skip
    tok = llm.get_tokenizer()
    questions = training_prompts(count, seed)
    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    while len(data["seqs"]) < count and time.time() - t0 < budget_s:
        done = len(data["seqs"])
        texts = [render(tok, q) for q in questions[done : done + chunk]]
        for o in llm.generate(texts, sp, use_tqdm=False):
            data["prompt_lens"].append(len(o.prompt_token_ids))
            data["seqs"].append(list(o.prompt_token_ids) + list(o.outputs[0].token_ids))
        path.write_text(json.dumps(data))
        print(f"answered {len(data['seqs'])} / {count} ({time.time() - t0:.0f} s)", flush=True)
    return data

def train_programs(hp: Any, lr: float, losses: dict[int, Any]) -> tuple[Any, Any, dict]:
    """(optimizer, its state for ``hp``, {bucket length: (jitted train step, jitted loss)})
    for a head's per-bucket losses ``loss(hp, tp, f, x, n, st) -> (loss, aux)``: AdamW
    without weight decay behind a global-norm clip of 1, the learning rate injected so a
    schedule can change it. Shared by the EAGLE and EAGLE-3 trainers."""
    import optax  # the ``train`` extra

    opt = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.adamw(learning_rate, weight_decay=0.0))
    )(learning_rate=lr)  # fmt: skip
    fns = {}
    for length, loss_fn in losses.items():

        def train_step(hp, state, tp, f, x, n, st, loss_fn=loss_fn):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(hp, tp, f, x, n, st)
            upd, state = opt.update(grads, state, hp)
            return optax.apply_updates(hp, upd), state, loss, aux

        fns[length] = (jax.jit(train_step), jax.jit(loss_fn))
    return opt, opt.init(hp), fns



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None, help="head directory (default: the user's cache)")
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="draft vocabulary size (most frequent answer ids; 0 = all)")
    ap.add_argument("--gen-budget", type=float, default=900.0,
                    help="seconds of answering at most (then train on what was answered)")
    ap.add_argument("--steps", type=int, default=100000, help="at most this many steps")
    ap.add_argument("--time-budget", type=float, default=300.0, help="training seconds")
    ap.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from pagedjax.config import ModelConfig
    from pagedjax.engine.loading import load_model

    t0 = time.time()
    out = Path(args.out).expanduser() if args.out else default_out(args.model)
    cache = default_out(args.model).parent / "data"
    name = f"{args.model}-{args.prompts}x{args.gen_tokens}-s{args.seed}.json"
    data = generate_data(args.model, args.prompts, args.gen_tokens, args.seed, cache / name,
                         args.gen_budget)  # fmt: skip
    seqs, plens = data["seqs"], data["prompt_lens"]
    t_gen = time.time() - t0
    ntok = sum(len(s) - p for s, p in zip(seqs, plens, strict=True))
    print(f"{len(seqs)} sequences, {ntok} answer tokens ({t_gen:.0f} s)", flush=True)
    arch, params, _, _ = load_model(ModelConfig(model=args.model))

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(seqs))
    held = max(1, len(seqs) // 10)
    test_set = set(order[:held].tolist())
    vocab = draft_vocabulary([seqs[i][plens[i]:] for i in order[held:]], args.draft_vocab,
                             arch.vocab_size)  # fmt: skip
    t2d = np.full(arch.vocab_size, -1, np.int32)
    t2d[vocab] = np.arange(len(vocab), dtype=np.int32)
    w = (params["embed_tokens"]["embedding"] if arch.tie_word_embeddings
         else params["lm_head"]["kernel"].T)  # fmt: skip
    tp = {"embed_tokens": params["embed_tokens"], "lm": jnp.asarray(np.asarray(w)[vocab]),
          "t2d": jnp.asarray(t2d)}  # fmt: skip

    # Length buckets: each bucket's sequences, teacher-forced features, split.
    buckets = {}
    for length in LENGTHS:
        idx = [i for i in range(len(seqs)) if bucket_length(len(seqs[i])) == length]
        if not idx:
            continue
        rows = max(1, args.batch_tokens // length)
        f = teacher_features(arch, params, [seqs[i] for i in idx], length, rows)
        x = np.zeros((len(idx), length), np.int32)
        for j, i in enumerate(idx):
            s = seqs[i][:length]
            x[j, : len(s)] = s
        n = np.asarray([min(len(seqs[i]), length) for i in idx], np.int32)
        st = np.asarray([max(plens[i] - 2, 0) for i in idx], np.int32)
        test = np.asarray([i in test_set for i in idx])
        buckets[length] = dict(rows=rows, f=f, x=x, n=n, start=st,
                               train=np.flatnonzero(~test), test=np.flatnonzero(test))  # fmt: skip
    t_feat = time.time() - t0 - t_gen
    print(f"teacher-forced features in {t_feat:.0f} s; buckets "
          f"{ {k: len(b['x']) for k, b in buckets.items()} }; draft vocabulary {len(vocab)}",
          flush=True)  # fmt: skip

    cfg = EagleConfig.for_target(arch, target=args.model)
    hp = init_head(cfg, arch, seed=args.seed)
    head_arch = cfg.head_arch(arch)
    opt, state, fns = train_programs(
        hp, args.lr, {n: make_loss(arch, head_arch, b["rows"], n, args.ce_weight)
                      for n, b in buckets.items()},
    )  # fmt: skip

    def pick(b: dict, idx: np.ndarray) -> tuple:
        return b["f"][idx], b["x"][idx], b["n"][idx], b["start"][idx]

    def evaluate(hp) -> float:
        """Held-out teacher-forced top-1 on answer positions (a miss outside the vocab)."""
        correct = counted = 0
        for length, b in buckets.items():
            t, rows = b["test"], b["rows"]
            for i in range(0, len(t), rows):
                idx = t[i : i + rows]
                idx = np.concatenate([idx, np.repeat(idx[:1], rows - len(idx))])
                nn_ = b["n"][idx].copy()
                nn_[len(t[i : i + rows]) :] = 0  # padding rows count nothing
                f, x, _, st = pick(b, idx)
                aux = fns[length][1](hp, tp, f, x, jnp.asarray(nn_), st)[1]
                correct, counted = correct + int(aux[2]), counted + int(aux[3])
        return correct / max(counted, 1)

    print(f"held-out top-1 before training: {evaluate(hp):.3f}", flush=True)
    lengths = list(buckets)
    weights = np.asarray([len(buckets[k]["train"]) * k for k in lengths], np.float64)
    t_train, step, loss = time.time(), 0, float("nan")
    while step < args.steps:
        frac = (time.time() - t_train) / args.time_budget
        if frac >= 1.0:
            break
        # Linear warm-up over 20 steps, cosine decay over the time budget.
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1.0 + np.cos(np.pi * frac))
        state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        length = lengths[rng.choice(len(lengths), p=weights / weights.sum())]
        b = buckets[length]
        idx = b["train"][rng.integers(0, len(b["train"]), b["rows"])]
        hp, state, loss, aux = fns[length][0](hp, state, tp, *pick(b, idx))
        step += 1
        if step % 25 == 0 or step == 1:
            reg, ce = float(aux[0]), float(aux[1])
            top1 = float(aux[2]) / max(float(aux[3]), 1.0)
            print(f"step {step} loss {float(loss):.3f} reg {reg:.3f} ce {ce:.3f} top1 {top1:.3f}"
                  f" lr {lr:.1e} ({time.time() - t_train:.0f} s)", flush=True)  # fmt: skip
    secs = time.time() - t_train
    top1 = evaluate(hp)
    print(f"trained {step} steps in {secs:.0f} s; held-out teacher-forced top-1 {top1:.3f}")
    meta = dict(steps=step, train_seconds=round(secs, 1), total_seconds=round(time.time() - t0, 1),
                final_loss=round(float(loss), 4), heldout_top1=round(top1, 4),
                sequences=len(seqs), held_out=held, answer_tokens=ntok,
                gen_tokens=args.gen_tokens, draft_vocab=len(vocab),
                batch_tokens=args.batch_tokens, lr=args.lr, ce_weight=args.ce_weight,
                load=round(os.getloadavg()[0], 1))  # fmt: skip
    full = len(vocab) == arch.vocab_size
    cfg = dataclasses.replace(cfg, train=meta, draft_vocab_size=0 if full else len(vocab))
    save_head(out, cfg, hp, draft_vocab=None if full else vocab)
    print(f"saved {out} ({json.dumps(meta)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
