"""A simulated KV hierarchy: device pool + host tier under prefix caching, at paper scale.

What it models (docs/kv_tiers.md, "Simulated tiers"):

- **Placement** (``TierCache``): a device pool of ``device_blocks`` blocks and a host tier
  of ``host_blocks`` (0: no host tier), each least recently used first. A device block is
  held by the requests using it (reference counts) or cached and evictable (reference
  0, keyed by its prefix: ``ConversationWorkload.block_keys``). Allocation takes an empty
  block, else evicts the least recently freed cached block; with a host tier the evicted
  block is copied there (the tier evicts its own LRU entry past its capacity). The host
  tier is **inclusive**, as the engine's (``memory/host_tier.py``): a block reloaded from
  the host stays there, so evicting it again costs no copy. Freed blocks join the device
  LRU tail first, then earlier blocks (vLLM's order: a prefix's last blocks go first).
- **Hits**: an arriving prompt's hit is the longest prefix of its full blocks each found
  on the device or on the host (device preferred), capped so that at least one prompt
  token is computed (the last token's logits; vLLM's rule). Host hits are loaded into
  fresh device blocks; the rest of the prompt is prefilled.
- **Time**: a continuous-batching server (FCFS admission while blocks and
  ``max_num_seqs`` allow; chunked prefill under ``max_num_batched_tokens``; every
  running request decodes one token per step). A step costs the GPU profile's roofline
  (``cost_model.RooflineCostModel``: the prefill tokens actually computed, the decodes,
  the KV read, the prefills' attention pairs), a host hit costs
  ``bytes / effective host-link bandwidth + copies x per-copy latency`` (``HostLink``).
  Reloads are asynchronous by default (vLLM's offloading connector: the request waits
  for its blocks, the batch does not; one copy stream, FIFO); ``reload="sync"`` adds them
  to the next step instead (pagedjax's engine today). Offloads (device -> host) are not
  charged: they run on the link's other direction, off the critical path (an assumption).
- **Simplifications** (stated, both arms share them): a request reserves blocks for its
  whole prompt + output at admission (no preemption); block-granular kernel costs and
  tensor-parallel communication beyond the roofline's own are left out; conversations
  are closed loops (a turn is sent no earlier than its previous turn's reply ends).

Why a host-side discrete-event model (numpy and Python) and not the jitted loop of
``simulate.py``: the tier state is two LRU orders over keyed blocks and a prefix walk per
arrival, data-dependent dictionaries that a fixed-shape ``lax.while_loop`` would carry as
large sorted arrays rewritten every step; the event count here is small (a few events
per request: an admission, a prefill chunk or two, the decode runs between arrivals and
finishes), so Python over events is fast enough (measured: 2,136 multi-turn requests
at 16x the pool, ~85,000 steps, 1.7-1.8 s at load 6 on the shared 2-core box). The step
cost is the roofline itself, read once into its affine pieces (``StepTime``) so that a
run of decode steps is one numpy expression.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedjax.simulator.cost_model import RooflineCostModel
from pagedjax.workloads.conversations import ConversationWorkload

# --- host link ----------------------------------------------------------------------


@dataclass(frozen=True)
class HostLink:
    """Host <-> GPU copies of KV blocks for one GPU.

    effective_bytes_per_s: sustained pinned-memory copy bandwidth, one direction.
    copy_latency_s: fixed cost of one copy (issue + DMA setup).
    source: where the numbers come from (they are assumptions, not fitted to a result).
    """

    name: str
    effective_bytes_per_s: float
    copy_latency_s: float
    source: str

    def __post_init__(self) -> None:
        if not self.effective_bytes_per_s > 0:
            raise ValueError(f"effective_bytes_per_s must be > 0, got {self.effective_bytes_per_s}")
        if self.copy_latency_s < 0:
            raise ValueError(f"copy_latency_s must be >= 0, got {self.copy_latency_s}")


_PCIE4 = (
    "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction (PCI-SIG); "
    "~80 % of it sustained for pinned host copies (25 GB/s, the usual bandwidthTest figure "
    "on A100 hosts: an assumption, not measured here)"
)
_PCIE5 = (
    "PCIe 5.0 x16: 32 GT/s x 16 lanes = 63 GB/s per direction (PCI-SIG); ~80 % sustained "
    "(50 GB/s: an assumption, not measured here)"
)
_COPY = (
    "; one copy per block (vLLM >= 0.12 keeps a block's KV of every layer contiguous, "
    "0.5-2 MB, and moves it by DMA: blog.vllm.ai 2026-01-08), 5 us each (launch + DMA "
    "setup, the cost model's swap assumption)"
)
HOST_LINKS: dict[str, HostLink] = {
    "A100-40GB": HostLink("A100-40GB", 25e9, 5e-6, _PCIE4 + _COPY),
    "A100-80GB": HostLink("A100-80GB", 25e9, 5e-6, _PCIE4 + _COPY),
    "H100-80GB": HostLink("H100-80GB", 50e9, 5e-6, _PCIE5 + _COPY),
    "H200": HostLink("H200", 50e9, 5e-6, _PCIE5 + _COPY),
}


def host_link(gpu: str) -> HostLink:
    if gpu not in HOST_LINKS:
        raise ValueError(f"gpu must be one of {sorted(HOST_LINKS)}, got {gpu!r}")
    return HOST_LINKS[gpu]


# --- placement ----------------------------------------------------------------------

DEVICE, HOST = 1, 2


class TierCache:
    """Where each block lives: a device pool and an optional host tier, LRU each.

    Device accounting: ``held_keyed`` (keys with reference count > 0) + ``anonymous``
    (held blocks without a key: not yet computed, partial, or a duplicate of a key
    already cached) + ``evictable`` (keys with count 0) + empty = ``device_blocks``.
    The host tier holds at most ``host_blocks`` keys (never more: checked by the tests).
    """

    def __init__(self, device_blocks: int, host_blocks: int = 0) -> None:
        if device_blocks < 1:
            raise ValueError(f"device_blocks must be >= 1, got {device_blocks}")
        if host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {host_blocks}")
        self.device_blocks = device_blocks
        self.host_blocks = host_blocks
        self._ref: dict[int, int] = {}  # device key -> reference count
        self._lru: OrderedDict[int, None] = OrderedDict()  # count-0 keys, oldest first
        self._host: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.anonymous = 0
        self.offloaded_blocks = 0  # device -> host copies
        self.host_evicted_blocks = 0
        self.device_evicted_blocks = 0

    # Views for tests and stats.
    @property
    def empty_blocks(self) -> int:
        return self.device_blocks - len(self._ref) - self.anonymous

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation could get now: empty + evictable."""
        return self.empty_blocks + len(self._lru)

    @property
    def host_size(self) -> int:
        return len(self._host)

    def device_keys(self) -> set[int]:
        return set(self._ref)

    def host_keys(self) -> set[int]:
        return set(self._host)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """int8[h]: the tier (DEVICE or HOST) of each block of the longest prefix of
        ``keys`` whose every block is cached somewhere (device first). No state change."""
        tiers = []
        for k in keys.tolist():
            if k in self._ref:
                tiers.append(DEVICE)
            elif k in self._host:
                tiers.append(HOST)
            else:
                break
        return np.array(tiers, np.int8)

    def acquire(self, keys: np.ndarray, tiers: np.ndarray, total_blocks: int) -> bool:
        """Holds ``total_blocks`` device blocks for a request whose hit is ``keys[:len(tiers)]``
        placed as ``tiers`` (from ``lookup``, unchanged since): device hits are shared
        (count + 1), host hits get fresh blocks registered under their keys (the host keeps
        its copy: inclusive), the rest are anonymous. False, with no change, when the
        pool cannot give the blocks now."""
        h = len(tiers)
        if total_blocks < h:
            raise ValueError(f"total_blocks ({total_blocks}) < hit blocks ({h})")
        hit = keys[:h].tolist()
        dev = [k for k, t in zip(hit, tiers.tolist(), strict=True) if t == DEVICE]
        pinned = sum(1 for k in dev if self._ref[k] == 0)
        need = total_blocks - len(dev)
        if self.available_blocks - pinned < need:
            return False
        for k in dev:
            if self._ref[k] == 0:
                del self._lru[k]
            self._ref[k] += 1
        host_hits = [k for k, t in zip(hit, tiers.tolist(), strict=True) if t == HOST]
        for k in host_hits:  # touched before the offloads below can push them out
            self._host.move_to_end(k)
        self._make_room(need)
        for k in host_hits:
            self._ref[k] = 1
        self.anonymous += need - (h - len(dev))
        return True

    def _make_room(self, n: int) -> None:
        while self.empty_blocks < n:
            k, _ = self._lru.popitem(last=False)
            del self._ref[k]
            self.device_evicted_blocks += 1
            self._offload(k)

    def _offload(self, key: int) -> None:
        if self.host_blocks == 0:
            return
        if key in self._host:  # inclusive: already kept, only touched
            self._host.move_to_end(key)
            return
        self._host[key] = None
        self.offloaded_blocks += 1
        if len(self._host) > self.host_blocks:
            self._host.popitem(last=False)
            self.host_evicted_blocks += 1

    def register(self, keys: np.ndarray) -> list[int]:
        """Gives anonymous held blocks these keys (their tokens are computed now); returns
        the keys registered. A key already on the device keeps its block, and ours stays
        anonymous (one cached copy per key, as vLLM's hash table)."""
        done = []
        for k in keys.tolist():
            if k in self._ref:
                continue
            if self.anonymous < 1:
                raise ValueError("register: no anonymous held block left to key")
            self._ref[k] = 1
            self.anonymous -= 1
            done.append(k)
        return done

    def release(self, keys: list[int], anonymous: int) -> None:
        """Drops a request's hold: its keyed blocks (count - 1; at 0 they become evictable,
        the last block first in line) and ``anonymous`` blocks (emptied)."""
        if anonymous > self.anonymous:
            raise ValueError(f"release: {anonymous} anonymous blocks, {self.anonymous} held")
        self.anonymous -= anonymous
        for k in reversed(keys):
            self._ref[k] -= 1
            if self._ref[k] == 0:
                self._lru[k] = None


# --- step time ----------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """A dense roofline's step time as numpy: max(mem . x, comp . x) + extra . x.

    x = (1, prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs, prefill_seqs).
    The pieces are read off the cost model's own methods (memory_time, compute_time,
    comm_time, step_overhead_s, seq_overhead_s) at probe points, then checked against its
    ``__call__`` at random points (relative error <= 1e-3); a model that is not affine in
    its pieces (an MoE's expected experts) is refused.
    """

    mem: np.ndarray
    comp: np.ndarray
    extra: np.ndarray

    @classmethod
    def from_roofline(cls, cm: RooflineCostModel) -> StepTime:
        if not isinstance(cm, RooflineCostModel):
            raise ValueError(f"cost model must be a RooflineCostModel, got {type(cm).__name__}")
        if cm.model.num_experts:
            raise ValueError(f"{cm.model.name}: an MoE's step time is not affine; dense only")
        probe = (1e6, 1e6, 1e6, 1e9, 1e4)

        def pieces(fn, used: tuple[int, ...]) -> np.ndarray:
            zero = [0.0] * 5
            base = float(fn(*[zero[i] for i in used]))
            coef = np.zeros(6)
            coef[0] = base
            for i in used:
                x = list(zero)
                x[i] = probe[i]
                coef[1 + i] = (float(fn(*[x[j] for j in used])) - base) / probe[i]
            return coef

        mem = pieces(cm.memory_time, (0, 1, 2))
        comp = pieces(cm.compute_time, (0, 1, 2, 3, 4))
        extra = pieces(cm.comm_time, (0, 1))
        extra[0] += cm.step_overhead_s
        extra[2] += cm.seq_overhead_s  # per decode sequence ...
        extra[5] += cm.seq_overhead_s  # ... and per prompt that emits a token
        st = cls(mem, comp, extra)
        rng = np.random.default_rng(0)
        for _ in range(8):
            x = rng.uniform(0, 1, 5) * np.array([4096, 256, 2e5, 4e6, 16])
            want = float(cm(*x))
            got = float(st(*x))
            if abs(got - want) > 1e-3 * want:
                raise ValueError(f"cost model is not affine in its pieces ({got} vs {want})")
        return st

    def __call__(self, prefill, decode, kv, pairs=0.0, prefill_seqs=0.0) -> Any:
        """Seconds (float or float64 array, broadcast over the inputs)."""
        x = (1.0, prefill, decode, kv, pairs, prefill_seqs)
        mem = sum(c * v for c, v in zip(self.mem, x, strict=True))
        comp = sum(c * v for c, v in zip(self.comp, x, strict=True))
        extra = sum(c * v for c, v in zip(self.extra, x, strict=True))
        return np.maximum(mem, comp) + extra


# --- the server ---------------------------------------------------------------------

RELOAD_MODES = ("async", "sync")


@dataclass(frozen=True)
class TierSimConfig:
    """The simulated server.

    device_blocks / host_blocks: the pools (host_blocks 0: no host tier).
    reload: "async" (vLLM's connector: a request waits for its host blocks on one FIFO
        copy stream while the batch runs) or "sync" (the copies are added to the next
        step: every running request waits).
    closed_loop: a conversation's turn is sent no earlier than its previous turn ends.
    """

    device_blocks: int
    host_blocks: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    reload: str = "async"
    closed_loop: bool = True

    def __post_init__(self) -> None:
        if self.reload not in RELOAD_MODES:
            raise ValueError(f"reload must be one of {RELOAD_MODES}, got {self.reload!r}")
        for k in ("device_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {self.host_blocks}")


@dataclass
class TierResult:
    """Per request (float64[N], seconds; every request finishes): sent_s (arrival, after
    the closed-loop wait), first_token_s, finish_s; the hits per tier per request; and
    totals."""

    sent_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    device_hits: np.ndarray  # int64[N]: prompt tokens each request found on the device
    host_hits: np.ndarray  # int64[N]: ... and on the host (loaded back)
    output_tokens: int
    prompt_tokens: int
    query_tokens: int  # prompt tokens looked up (all of them)
    device_hit_tokens: int
    host_hit_tokens: int
    computed_prompt_tokens: int
    offloaded_blocks: int
    reloaded_blocks: int
    reloaded_bytes: float
    reload_s: float  # copy time of all reloads, summed
    steps: int
    host_peak_blocks: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.sent_s

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max() - self.sent_s.min()) if len(self.sent_s) else 0.0

    def summary(self) -> dict[str, float]:
        t = self.ttft_s
        q = max(self.query_tokens, 1)
        span = max(self.makespan_s, 1e-12)
        return dict(
            ttft_p50_ms=float(np.percentile(t, 50) * 1e3),
            ttft_p90_ms=float(np.percentile(t, 90) * 1e3),
            output_tok_per_s=self.output_tokens / span,
            requests_per_s=len(t) / span,
            device_hit_rate=self.device_hit_tokens / q,
            host_hit_rate=self.host_hit_tokens / q,
            hit_rate=(self.device_hit_tokens + self.host_hit_tokens) / q,
            computed_prompt_tokens=float(self.computed_prompt_tokens),
            reloaded_gb=self.reloaded_bytes / 1e9,
            offloaded_blocks=float(self.offloaded_blocks),
            makespan_s=self.makespan_s,
        )


@dataclass
class _Req:
    idx: int
    prompt: int
    out_len: int
    total_blocks: int
    computed: int = 0  # prompt tokens in the cache (hits + chunks done)
    out_done: int = 0
    ready_at: float = 0.0  # host blocks loaded by then
    keys: list[int] = field(default_factory=list)  # keyed blocks held
    anonymous: int = 0


def simulate_tiers(
    workload: ConversationWorkload,
    cost_model: RooflineCostModel,
    config: TierSimConfig,
    link: HostLink | None = None,
) -> TierResult:
    """Serves ``workload`` on the simulated server (module docstring).

    link: the host link (default: ``HOST_LINKS[cost_model.gpu.name]``).
    Raises ValueError for a request that needs more blocks than the device pool.
    """
    link = host_link(cost_model.gpu.name) if link is None else link
    step_time = StepTime.from_roofline(cost_model)
    geom = cost_model.model
    bs = config.block_size
    block_bytes = bs * geom.kv_bytes_per_token_per_gpu
    cache = TierCache(config.device_blocks, config.host_blocks)
    w = workload.requests
    n = len(w)
    prompt_len = w.prompt_len.astype(np.int64)
    out_len = w.output_len.astype(np.int64)
    total_blocks = -(-(prompt_len + out_len) // bs)
    too_big = np.flatnonzero(total_blocks > config.device_blocks)
    if len(too_big):
        i = int(too_big[0])
        raise ValueError(
            f"request {i} needs {total_blocks[i]} blocks, the device pool has "
            f"{config.device_blocks}"
        )
    # Turns of each conversation in order; the first ones are sent at their arrival.
    by_conv: dict[int, deque[int]] = {}
    for i in np.argsort(w.arrival_time, kind="stable").tolist():
        by_conv.setdefault(int(workload.conversation[i]), deque()).append(i)
    heap: list[tuple[float, int]] = []
    if config.closed_loop:
        for turns in by_conv.values():
            i = turns.popleft()
            heapq.heappush(heap, (float(w.arrival_time[i]), i))
    else:
        heap = [(float(w.arrival_time[i]), i) for i in range(n)]
        heapq.heapify(heap)

    sent = np.full(n, np.nan)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    dev_hits = np.zeros(n, np.int64)
    host_hits = np.zeros(n, np.int64)
    waiting: deque[int] = deque()
    running: list[_Req] = []
    t = 0.0
    link_free = 0.0
    sync_due = 0.0
    stats = dict(query=0, dev=0, host=0, computed=0, reloaded=0, reload_s=0.0, steps=0)
    host_peak = 0
    done = 0

    def admit() -> None:
        nonlocal link_free, sync_due, host_peak
        while waiting and len(running) < config.max_num_seqs:
            i = waiting[0]
            p = int(prompt_len[i])
            keys = workload.block_keys(i, bs)[: (p - 1) // bs]  # >= 1 token computed
            tiers = cache.lookup(keys)
            if not cache.acquire(keys, tiers, int(total_blocks[i])):
                return
            waiting.popleft()
            n_host = int((tiers == HOST).sum())
            hit_keys = keys[: len(tiers)].tolist()
            r = _Req(i, p, int(out_len[i]), int(total_blocks[i]), computed=len(tiers) * bs,
                     keys=hit_keys, anonymous=int(total_blocks[i]) - len(tiers))  # fmt: skip
            stats["query"] += p
            dev_hits[i] = int((tiers == DEVICE).sum()) * bs
            host_hits[i] = n_host * bs
            stats["dev"] += dev_hits[i]
            stats["host"] += host_hits[i]
            r.ready_at = t
            if n_host:
                dt = n_host * (link.copy_latency_s + block_bytes / link.effective_bytes_per_s)
                stats["reloaded"] += n_host
                stats["reload_s"] += dt
                if config.reload == "async":
                    link_free = max(link_free, t) + dt
                    r.ready_at = link_free
                else:
                    sync_due += dt
            host_peak = max(host_peak, cache.host_size)
            running.append(r)

    def finish_req(r: _Req, at: float) -> None:
        nonlocal done
        finish[r.idx] = at
        got = cache.register(workload.output_block_keys(r.idx, bs))
        r.keys.extend(got)
        r.anonymous -= len(got)
        cache.release(r.keys, r.anonymous)
        done += 1
        conv = int(workload.conversation[r.idx])
        if config.closed_loop and by_conv[conv]:
            j = by_conv[conv].popleft()
            heapq.heappush(heap, (max(float(w.arrival_time[j]), at), j))

    while done < n:
        while heap and heap[0][0] <= t:
            at, i = heapq.heappop(heap)
            sent[i] = at
            waiting.append(i)
        admit()
        prefilling = [r for r in running if r.computed < r.prompt and r.ready_at <= t]
        decoding = [r for r in running if r.computed >= r.prompt]
        if not prefilling and not decoding:
            nxt = [r.ready_at for r in running if r.ready_at > t]
            if heap:
                nxt.append(heap[0][0])
            if not nxt:
                raise RuntimeError("simulate_tiers: stuck (nothing runs, nothing arrives)")
            t = max(t, min(nxt))
            continue
        if prefilling:
            budget = config.max_num_batched_tokens - len(decoding)
            chunks = []
            for r in prefilling:
                if budget <= 0:
                    break
                q = min(r.prompt - r.computed, budget)
                budget -= q
                chunks.append((r, q))
            q_arr = np.array([q for _, q in chunks], np.float64)
            s_arr = np.array([r.computed for r, _ in chunks], np.float64)
            emits = sum(1 for r, q in chunks if r.computed + q >= r.prompt)
            ctx = sum(r.prompt + r.out_done for r in decoding)
            dt = float(step_time(q_arr.sum(), len(decoding), ctx + s_arr.sum(),
                                 float((q_arr * (q_arr + 1) / 2 + q_arr * s_arr).sum()),
                                 emits))  # fmt: skip
            dt += sync_due
            sync_due = 0.0
            t += dt
            stats["steps"] += 1
            for r in decoding:
                r.out_done += 1
            for r, q in chunks:
                r.computed += q
                stats["computed"] += q
                if r.computed >= r.prompt:
                    first[r.idx] = t
                    r.out_done = 1
                    got = cache.register(workload.block_keys(r.idx, bs)[len(r.keys) :])
                    r.keys.extend(got)
                    r.anonymous -= len(got)
        else:
            # A run of identical decode steps up to the next event (a finish, an arrival,
            # a request's host blocks landing): one numpy expression.
            k_max = min(r.out_len - r.out_done for r in decoding)
            events = [r.ready_at for r in running if r.ready_at > t]
            if heap:
                events.append(heap[0][0])
            nd = len(decoding)
            ctx = sum(r.prompt + r.out_done for r in decoding)
            steps = np.arange(max(k_max, 1), dtype=np.float64)
            cum = np.cumsum(step_time(0.0, nd, ctx + nd * steps))
            k = len(cum)
            if events:
                cross = int(np.searchsorted(cum, min(events) - t))
                k = min(k, cross + 1)
            k = max(k, 1)
            t += float(cum[k - 1]) + sync_due
            sync_due = 0.0
            stats["steps"] += k
            for r in decoding:
                r.out_done += k
        still = []
        for r in running:
            if r.computed >= r.prompt and r.out_done >= r.out_len:
                finish_req(r, t)
            else:
                still.append(r)
        running[:] = still

    return TierResult(
        sent_s=sent,
        first_token_s=first,
        finish_s=finish,
        device_hits=dev_hits,
        host_hits=host_hits,
        output_tokens=int(out_len.sum()),
        prompt_tokens=int(prompt_len.sum()),
        query_tokens=stats["query"],
        device_hit_tokens=stats["dev"],
        host_hit_tokens=stats["host"],
        computed_prompt_tokens=stats["computed"],
        offloaded_blocks=cache.offloaded_blocks,
        reloaded_blocks=stats["reloaded"],
        reloaded_bytes=stats["reloaded"] * block_bytes,
        reload_s=stats["reload_s"],
        steps=stats["steps"],
        host_peak_blocks=host_peak,
    )
