"""How many drafts each row verifies this step: the batch-size table and the automatic rule.

Speculation pays when the tokens a step emits grow faster than its cost. At batch 1 on a
CPU a step of 5 rows costs about what a step of 1 row costs (both are weight-bound), so
any accepted draft is a gain; at batch 64 a step of 64 * (1 + k) rows is compute-bound
and costs several times the plain step, so k = 4 drafts that are accepted 20 % of the
time lose (measured 0.60-0.70x, docs/speculative_decoding.md). Two rules size k:

- ``batch_size_lookup``: vLLM's ``num_speculative_tokens_per_batch_size`` table, k as a
  function of the step's batch size only (``build_dynamic_sd_schedule_lookup``'s rules:
  gaps take the previous range's k, batch sizes past the last range the last k, every k
  capped at num_speculative_tokens). k = 0 makes the step a plain step.
- ``allocate`` (pagedjax's ``auto_num_speculative_tokens``): per row, from the measured
  acceptance and the measured cost of the step's program. With per-draft acceptance
  alpha_r (each draft accepted with probability alpha_r given the ones before it were,
  the i.i.d. model of Leviathan et al.), a row with k drafts emits on average
  1 + alpha_r + ... + alpha_r^k tokens, so its j-th draft adds alpha_r^j. The step's
  cost depends on its padded (T, S) bucket and on whether it verifies. ``allocate``
  takes the n largest gains over all rows (always a per-row prefix: alpha^j falls with
  j) for the n that maximises (rows + gains) / cost(n), n = 0 included: the exact
  optimum of that model (tested against brute force).

Draft trees (``allocate_levels``): a row's tree is cut by **levels**, the unit the rule
measures. Its nodes are laid out breadth-first (``bfs_order``; EAGLE's level-major
layout already is), so keeping depths 1 .. d keeps a prefix of the nodes, itself a tree
(what the scheduler and ``tree.py`` rely on). The model is the chain's on levels:
alpha_r is the row's per-level acceptance (the path reaches depth j + 1 given it reached
j, measured as a chain's drafts are: levels verified, levels accepted), so level j adds
alpha_r^j expected tokens and costs its width w_{r,j} nodes (the verification's rows).
``allocate_levels`` maximises (rows + sum of kept levels' alpha_r^j) / cost(nodes kept)
exactly for that model: a dynamic programme over rows gives, for every node total n, the
largest gain with exactly n nodes (each row keeps a depth prefix), then the best n.
For a chain (every width 1) it is ``allocate``. What the model leaves out: a wider
level is accepted more often than a narrower one (alpha_r is measured on the row's
trees as the proposer makes them, so it averages over their widths), and nodes inside a
level are kept or dropped together.

Acceptance (``Acceptance``): per slot, the geometric model's maximum-likelihood estimate
accepted / (accepted + rejections) (each verified row contributes its accepted drafts
and, when it stopped short of its drafts, one rejection), shrunk towards a decaying
global estimate so a new sequence starts from what the others saw. accepted / proposed
would underestimate alpha: drafts after the first rejection are never tried.

Cost (``StepCost``): an exponential moving average of the measured seconds of each
(drafts, T, S) key (drafts: some row has drafts), the whole step from dispatch to the
tokens on the host, drafting programs included: the proposal programs and, for the
methods whose head keeps state (EAGLE / EAGLE-3 head KV and features, Medusa features, a
separate draft's KV), the work a step without drafts still does to keep it (their
catch-up / forward), so cost(0) is that method's no-draft step, not the plain one. The
first measurement of a key is dropped (it may hold the compilation). An unmeasured key
is estimated optimistically, so it gets tried (twice: the first is dropped) and
measured, after which the measurement decides: a plain key at 0 (tried first), a
verifying key at the cheapest measured key with T no larger. A measured key the rule
stopped choosing is run again after REFRESH_STEPS steps (``StepCost.stale``: the
no-draft step while drafting) and that new measurement replaces its average, so one slow
measurement of the plain step on a shared machine cannot lock the rule into drafting.

Compilation: the verification program is compiled per (T, S) bucket with the static K =
num_speculative_tokens, whatever each row's k (``verify.py``); drafting programs are per
S bucket (layer-skip, EAGLE: the proposal on ``head_rows`` of the drafting rows, powers
of two within S) or (T, S) bucket (a separate draft). So any k schedule runs within the
fixed set {plain step, verification} x the runner's bucket pairs, plus the draft
programs' buckets: no program is compiled per k (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

PRIOR_ALPHA = 0.5  # global acceptance before any measurement (one accept, one reject)
SLOT_WEIGHT = 2.0  # pseudo-trials of the global estimate in each slot's
GLOBAL_DECAY = 0.98  # per verified step: the global estimate follows the workload
COST_WEIGHT = 0.3  # weight of a new measurement in a key's moving average
REFRESH_STEPS = 16  # a measured key not run for this many steps is run (measured) again


def batch_size_lookup(table: Sequence[Sequence[int]], max_batch: int, k: int) -> np.ndarray:
    """int32[max_batch + 1]: drafts per row for a step of B sequences at index B (index 0
    unused). table: validated ((bs_lo, bs_hi, k), ...), sorted (``config``)."""
    dense = np.zeros(max_batch + 1, np.int32)
    nxt, last = 1, None
    for lo, hi, kk in sorted(table):
        if lo > nxt and last is not None:
            dense[nxt : min(lo, max_batch + 1)] = min(k, last)
        dense[max(lo, nxt) : min(hi, max_batch) + 1] = min(k, kk)
        nxt, last = max(nxt, hi + 1), kk
        if nxt > max_batch:
            break
    if last is not None and nxt <= max_batch:
        dense[nxt:] = min(k, last)
    dense[0] = dense[1] if max_batch >= 1 else 0
    return dense


def allocate(alpha: np.ndarray, caps: np.ndarray, rows: int,
             cost: Callable[[int], float | None]) -> np.ndarray:  # fmt: skip
    """int[R] drafts per row (<= caps) maximising (rows + sum_r sum_{j<=k_r} alpha_r^j) /
    cost(sum_r k_r). alpha float[R] in [0, 1]; caps int[R] >= 0; rows: rows the step
    emits for (each emits one token without drafts); cost(n) -> seconds of the step with
    n drafts, None when unknown (then every row keeps its cap). Ties: fewer drafts."""
    alpha = np.clip(np.asarray(alpha, np.float64), 0.0, 1.0)
    caps = np.maximum(np.asarray(caps, np.int64), 0)
    total = int(caps.sum())
    if total == 0:
        return caps
    owner = np.repeat(np.arange(len(caps)), caps)
    j = np.concatenate([np.arange(1, c + 1) for c in caps if c > 0])
    gain = alpha[owner] ** j
    order = np.lexsort((j, -gain))  # largest gain first; within a row, j ascending
    value = rows + np.concatenate([[0.0], np.cumsum(gain[order])])
    costs = [cost(n) for n in range(total + 1)]
    if any(c is None for c in costs):
        return caps
    rate = value / np.maximum(np.asarray(costs, np.float64), 1e-12)
    best = int(np.argmax(rate >= rate.max() * (1 - 1e-9)))  # the smallest n at the max
    return np.bincount(owner[order[:best]], minlength=len(caps)).astype(np.int64)


def allocate_levels(alpha: np.ndarray, widths: Sequence[np.ndarray], rows: int,
                    cost: Callable[[int], float | None]) -> np.ndarray:  # fmt: skip
    """int[R] levels kept per row maximising (rows + sum_r sum_{j<=d_r} alpha_r^j) /
    cost(sum_r sum_{j<=d_r} widths[r][j-1]). alpha float[R] in [0, 1]; widths[r]: int
    nodes at depth 1, 2, ... of row r's tree (>= 1 each; len = the row's depth cap);
    cost(n) -> seconds of the step with n draft nodes, None when unknown (then every row
    keeps every level). Exact for the model (the module docstring): for each node total
    n, the largest gain over depth prefixes with exactly n nodes (a dynamic programme,
    O(R * depth * N) for N nodes in all), then the n with the best rate; ties: fewer
    nodes. Cost: a few numpy passes per row (R = 64, depth 4, 1024 nodes: ~1 ms)."""
    alpha = np.clip(np.asarray(alpha, np.float64), 0.0, 1.0)
    ws = [np.asarray(w, np.int64) for w in widths]
    depth = np.array([len(w) for w in ws], np.int64)
    if not len(ws) or depth.sum() == 0:
        return depth
    total = int(sum(int(w.sum()) for w in ws))
    costs = [cost(n) for n in range(total + 1)]
    if any(c is None for c in costs):
        return depth
    best = np.full(total + 1, -np.inf)
    best[0] = 0.0
    choice = np.zeros((len(ws), total + 1), np.int64)  # levels row r keeps at total n
    for r, w in enumerate(ws):
        nodes = np.concatenate([[0], np.cumsum(w)])
        gain = np.concatenate([[0.0], np.cumsum(alpha[r] ** np.arange(1, len(w) + 1))])
        new = best.copy()  # d = 0
        for d in range(1, len(w) + 1):  # ascending d with a strict > : fewer nodes on ties
            cand = np.full(total + 1, -np.inf)
            cand[nodes[d] :] = best[: total + 1 - nodes[d]] + gain[d]
            better = cand > new + 1e-12
            new[better], choice[r, better] = cand[better], d
        best = new
    rate = (rows + best) / np.maximum(np.asarray(costs, np.float64), 1e-12)
    n = int(np.argmax(rate >= np.max(rate) * (1 - 1e-9)))  # the smallest n at the max
    keep = np.zeros(len(ws), np.int64)
    for r in range(len(ws) - 1, -1, -1):  # back through the programme
        keep[r] = choice[r, n]
        n -= int(ws[r][: keep[r]].sum())
    return keep


def choose_with_refresh(choose: Callable[[Callable[[int], float]], np.ndarray],
                        key: Callable[[int], tuple], table: StepCost) -> np.ndarray:  # fmt: skip
    """The rule's allocation with the no-draft step's measurement kept fresh
    (``StepCost.stale``). choose(cost) -> int[R] drafts (or nodes) per row maximising the
    rate under cost(n); key(n) -> the cost key of a step with n drafts. Returns choose's
    allocation under the measured costs, or zeros while drafting when the no-draft key's
    measurement is stale. One way only: a rule locked out of drafting by one slow
    measurement loses its gain, one locked into drafting is slower than no speculation
    (the issue's "never slower"), and forcing a drafting step every REFRESH_STEPS would
    cost a drafting step's excess over a plain one each time (a layer-skip draft: k
    passes of its layers over the rows)."""
    k = choose(lambda m: table.estimate(key(m)))
    if k.sum() and table.stale(key(0)):
        return np.zeros_like(k)
    return k


def node_levels(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """int64[n] depth of each node (1 = a root child); parents first, -1 = root."""
    par = np.asarray(parents, np.int64)
    depth = np.zeros(len(par), np.int64)
    for i, p in enumerate(par):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return depth


def bfs_order(parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tree's nodes breadth-first (stable by depth): (order int[n]: old index of each
    new node, parents int32[n] renumbered, depth int[n] of the new nodes, 1 = a root
    child). parents: parents first (-1 = root), as the proposers give them."""
    par = np.asarray(parents, np.int64)
    depth = node_levels(par)
    order = np.argsort(depth, kind="stable")
    new_of = np.empty(len(par), np.int64)
    new_of[order] = np.arange(len(par))
    old_par = par[order]
    new_par = np.where(old_par < 0, -1, new_of[np.maximum(old_par, 0)]).astype(np.int32)
    return order, new_par, depth[order]


class Acceptance:
    """Per-slot and global per-draft acceptance (the module docstring)."""

    def __init__(self, max_seqs: int):
        self.accepted = np.zeros(max_seqs)
        self.rejected = np.zeros(max_seqs)
        self.owner: list[int | None] = [None] * max_seqs
        self.global_accepted, self.global_rejected = PRIOR_ALPHA, 1.0 - PRIOR_ALPHA

    def bind(self, slot: int, owner: int) -> None:
        """Reset a slot's counts when a new sequence holds it."""
        if self.owner[slot] != owner:
            self.owner[slot] = owner
            self.accepted[slot] = self.rejected[slot] = 0.0

    def alpha(self, slots: np.ndarray) -> np.ndarray:
        g = self.global_accepted / (self.global_accepted + self.global_rejected)
        a, r = self.accepted[slots], self.rejected[slots]
        return (a + SLOT_WEIGHT * g) / (a + r + SLOT_WEIGHT)

    def record(self, slots: np.ndarray, drafts: np.ndarray, accepted: np.ndarray) -> None:
        """One verified step's rows: their slots, drafts verified and drafts accepted."""
        live = drafts > 0
        slots, drafts, accepted = slots[live], drafts[live], accepted[live]
        if not slots.size:
            return
        rejected = (accepted < drafts).astype(np.float64)
        np.add.at(self.accepted, slots, accepted)
        np.add.at(self.rejected, slots, rejected)
        self.global_accepted = self.global_accepted * GLOBAL_DECAY + float(accepted.sum())
        self.global_rejected = self.global_rejected * GLOBAL_DECAY + float(rejected.sum())


class StepCost:
    """Moving average of measured step seconds by program key (module docstring)."""

    def __init__(self) -> None:
        self.seconds: dict[tuple, float] = {}
        self.seen: set[tuple] = set()
        self.steps = 0  # observations so far
        self.last: dict[tuple, int] = {}  # key -> the observation that last ran it

    def observe(self, key: tuple, seconds: float) -> None:
        """One step's seconds under key. A stale key's average is replaced, not blended:
        it is as old as the steps since it last ran (``stale``)."""
        fresh = not self.stale(key)
        self.steps += 1
        self.last[key] = self.steps
        if key not in self.seen:  # the first run of a key may hold its compilation
            self.seen.add(key)
            return
        old = self.seconds.get(key) if fresh else None
        self.seconds[key] = seconds if old is None else old + COST_WEIGHT * (seconds - old)

    def estimate(self, key: tuple) -> float:
        """The key's average. Unmeasured, optimistically, so it is tried and measured: a
        plain key (key[0] False) at 0, tried first (else a rule that keeps drafting would
        never learn what the plain step costs); a verifying key at the cheapest measured
        key with T no larger (0 when none)."""
        if key in self.seconds:
            return self.seconds[key]
        if not key[0]:
            return 0.0
        smaller = [v for (_, t, _), v in self.seconds.items() if t <= key[1]]
        return min(smaller, default=0.0)

    def stale(self, key: tuple) -> bool:
        """Measured, but not run in the last REFRESH_STEPS steps. Its average may hold a
        transient (on a shared machine one step can take twice another's time), and a
        rule that stopped choosing the key would never correct it: the rule runs the
        no-draft key once more (``choose_with_refresh``), at most one step in
        REFRESH_STEPS."""
        return key in self.seconds and self.steps - self.last[key] >= REFRESH_STEPS


__all__ = ["Acceptance", "StepCost", "allocate", "allocate_levels", "batch_size_lookup",
           "bfs_order", "choose_with_refresh", "node_levels"]
