"""Multi-LoRA serving, simulated at paper scale: adapter memory, loading and the delta's cost.

What it models (docs/lora.md, "Simulated: S-LoRA at paper scale"):

- **Adapters** (``AdapterSpec``): adapter i has rank ``ranks[i % len(ranks)]`` (S-LoRA's
  mixed-rank settings cycle through their rank list the same way) on ``target_modules``
  of every layer; its A [in, r] and B [r, out] are ``adapter_bytes`` in the model's dtype.
  All adapters live in host memory; a request needs its adapter on the device.
- **Memory** (``LoRASimConfig.memory``), one device budget ``budget_bytes`` for KV and
  adapters in every mode:

  * ``unified`` (S-LoRA's unified paging): one pool of KV blocks; a resident adapter holds
    ceil(adapter_bytes / block bytes) of its blocks (exact rank, no padding). An adapter
    no running request uses stays resident but evictable, least recently used first, when
    a request needs blocks for its KV or for its own adapter.
  * ``separate`` (vLLM's ``max_loras``, S-LoRA's "no unified memory" ablation): a fixed
    adapter pool of ``max_loras`` slots, each the size of the largest rank's adapter (a
    slot must take any adapter: pagedjax's and vLLM's tables pad to ``max_lora_rank``),
    carved out of the budget; the KV pool is the rest. A request whose adapter is not
    resident needs a slot: a free one, else the least recently used adapter no running
    request uses is evicted; when every slot's adapter is in use the request is skipped
    and later ones may go first (vLLM's scheduler), until a slot frees.
  * ``none``: the base model alone (every request a base request, the whole budget KV).

- **Loading**: bringing an adapter to the device costs adapter_bytes / (host link x
  efficiency) + one copy per layer at the copy latency: the cost model's own swap numbers
  (``RooflineCostModel.swap_time``'s: an A100's PCIe 4.0 x16, 32 GB/s x 0.8, 5 us per
  copy). ``load="async"`` (S-LoRA prefetches on a side stream): the request waits for its
  adapter on one FIFO copy stream, the batch does not; ``"sync"`` (vLLM activates
  adapters before the step): the copy is added to the next step. It is charged once per
  activation: an adapter already resident (even unused) costs nothing.
- **The delta's cost** (``LoRAStepCost``): the roofline of the step gains the LoRA
  matmuls' bytes in its memory term and their FLOPs in its compute term (2 per adapter
  parameter per token). Bytes of A and B, by ``kernel``:

  * ``grouped`` (default): each *distinct* adapter in the batch is read once per step.
    That is Punica's SGMV (Chen et al., 2023: rows grouped in segments by adapter, each
    segment's weights loaded once) and S-LoRA's MBGMM / MBGMV kernels (gather the batch's
    adapters from the pool once, non-contiguous pages), i.e. what serving kernels on a GPU
    read from HBM.
  * ``gathered``: each LoRA *token* reads its adapter's weights (A[slot], B[slot] gathered
    per row, as pagedjax's ``model.lora_delta`` does on CPU, and a BGMV kernel without
    cache reuse would): an upper bound, rows x bytes.

- **The server** (both memories alike): FCFS admission while KV blocks and
  ``max_num_seqs`` allow, a request reserving blocks for its whole prompt + output (its
  output length is known: ``ignore_eos`` traces; no preemption); chunked prefill under
  ``max_num_batched_tokens``, every running request decoding one token per step. The step
  cost is the roofline (``kv_tiers.StepTime``) plus the LoRA terms; runs of identical
  decode steps are one numpy expression between events (arrival, finish, a load landing).

Why a host-side event model (as ``kv_tiers``) and not ``simulate.py``'s jitted loop: the
adapter state is an LRU over keyed adapters with pins, and the separate pool's skip rule
scans the queue; that is dictionary work a fixed-shape ``lax.while_loop`` would carry as
arrays rewritten every step. ``simulate.py`` and its results are untouched.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedjax.simulator.cost_model import ModelGeometry, RooflineCostModel
from pagedjax.simulator.kv_tiers import StepTime
from pagedjax.workloads.adapters import AdapterWorkload

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEMORY_MODES = ("unified", "separate", "none")
KERNELS = ("grouped", "gathered")
LOAD_MODES = ("async", "sync")


def module_dims(geom: ModelGeometry, name: str) -> tuple[int, int]:
    """(in, out) of one targeted linear of a Llama-style layer. ValueError for a module
    the geometry lacks (gate / up / down need a gated MLP)."""
    h, q, kv, f = (geom.hidden, geom.num_heads * geom.head_dim,
                   geom.num_kv_heads * geom.head_dim, geom.intermediate)  # fmt: skip
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if geom.gated_mlp:
        dims.update(gate_proj=(h, f), up_proj=(h, f), down_proj=(f, h))
    if name not in dims:
        raise ValueError(
            f"{geom.name} has no LoRA-targetable module {name!r}; one of {sorted(dims)}"
        )
    return dims[name]


@dataclass(frozen=True)
class AdapterSpec:
    """The adapters' shapes: adapter i has rank ``ranks[i % len(ranks)]`` on
    ``target_modules`` (default S-LoRA's: q, k, v, o projections) of every layer."""

    ranks: tuple[int, ...] = (16,)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"ranks must be a non-empty tuple of ranks >= 1, got {self.ranks}")
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(
                f"target_modules must be distinct and non-empty: {self.target_modules}"
            )
        for m in self.target_modules:
            if m not in MODULES:
                raise ValueError(f"unknown target module {m!r}; one of {MODULES}")

    def rank(self, adapter: int) -> int:
        return self.ranks[adapter % len(self.ranks)]

    def params_per_rank(self, geom: ModelGeometry) -> int:
        """Parameters of A and B per unit of rank, all layers: sum over modules of in + out."""
        if geom.tp != 1 or geom.num_experts:
            raise ValueError("the LoRA simulator models one GPU and a dense model")
        return geom.num_layers * sum(sum(module_dims(geom, m)) for m in self.target_modules)

    def adapter_bytes(self, geom: ModelGeometry, adapter: int) -> int:
        """Device bytes of adapter ``adapter`` (A and B of every target, model dtype)."""
        return self.params_per_rank(geom) * self.rank(adapter) * geom.bytes_per_param


@dataclass(frozen=True)
class LoRAStepCost:
    """Step seconds = max(base memory time + LoRA bytes / (mem_eff x HBM), base compute
    time + LoRA FLOPs / (flop_eff x peak)) + communication + overhead: the roofline of
    ``cost_model`` (its affine pieces, ``kv_tiers.StepTime``) with the delta's work added
    to the two terms it belongs to. Vectorized over numpy arrays."""

    step: StepTime
    bytes_per_s: float
    flops_per_s: float

    @classmethod
    def from_roofline(cls, cm: RooflineCostModel) -> LoRAStepCost:
        return cls(StepTime.from_roofline(cm), cm.mem_efficiency * cm.gpu.hbm_bytes_per_s,
                   cm.flop_efficiency * cm.gpu.peak_flops)  # fmt: skip

    def __call__(self, prefill, decode, kv, pairs=0.0, prefill_seqs=0.0, lora_bytes=0.0,
                 lora_flops=0.0) -> Any:  # fmt: skip
        s = self.step
        x = (1.0, prefill, decode, kv, pairs, prefill_seqs)
        mem = sum(c * v for c, v in zip(s.mem, x, strict=True)) + lora_bytes / self.bytes_per_s
        comp = sum(c * v for c, v in zip(s.comp, x, strict=True)) + lora_flops / self.flops_per_s
        extra = sum(c * v for c, v in zip(s.extra, x, strict=True))
        return np.maximum(mem, comp) + extra


@dataclass(frozen=True)
class LoRASimConfig:
    """The simulated server (module docstring). budget_bytes: device bytes for KV blocks
    and adapters together; max_loras: the separate pool's slots (ignored otherwise)."""

    budget_bytes: float
    memory: str = "unified"
    max_loras: int = 8
    block_size: int = 16
    max_num_batched_tokens: int = 2560
    max_num_seqs: int = 256
    kernel: str = "grouped"
    load: str = "async"

    def __post_init__(self) -> None:
        for name, val, allowed in (("memory", self.memory, MEMORY_MODES),
                                   ("kernel", self.kernel, KERNELS),
                                   ("load", self.load, LOAD_MODES)):  # fmt: skip
            if val not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {val!r}")
        for k in ("max_loras", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if not self.budget_bytes > 0:
            raise ValueError(f"budget_bytes must be > 0, got {self.budget_bytes}")


@dataclass
class LoRAResult:
    """Per request (float64[N] seconds): arrival, first token, finish; and totals."""

    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output_tokens: int
    steps: int
    kv_blocks: int  # the KV pool (unified: adapters take their pages out of it)
    max_batch: int  # most sequences in one step
    mean_batch: float  # time-weighted over busy time
    loads: int  # adapter activations (host -> device copies)
    evictions: int
    load_bytes: float
    load_s: float  # copy time of all loads, summed
    skips: int  # admissions deferred for want of an adapter slot (separate)
    busy_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max() - self.arrival_s.min()) if len(self.finish_s) else 0.0

    def summary(self) -> dict[str, float]:
        span = max(self.makespan_s, 1e-12)
        ttft = self.first_token_s - self.arrival_s
        return dict(
            requests_per_s=len(self.finish_s) / span,
            output_tok_per_s=self.output_tokens / span,
            mean_latency_s=float(np.mean(self.finish_s - self.arrival_s)),
            ttft_p50_s=float(np.percentile(ttft, 50)),
            max_batch=float(self.max_batch),
            mean_batch=self.mean_batch,
            kv_blocks=float(self.kv_blocks),
            loads=float(self.loads),
            evictions=float(self.evictions),
            load_gb=self.load_bytes / 1e9,
            load_s=self.load_s,
            skips=float(self.skips),
            makespan_s=self.makespan_s,
            steps=float(self.steps),
        )


@dataclass
class _Req:
    idx: int
    prompt: int
    out_len: int
    blocks: int
    adapter: int  # -1: base model
    computed: int = 0
    out_done: int = 0
    ready_at: float = 0.0


def simulate_lora(
    workload: AdapterWorkload,
    cost_model: RooflineCostModel,
    spec: AdapterSpec,
    config: LoRASimConfig,
) -> LoRAResult:
    """Serves ``workload`` on the simulated multi-LoRA server (module docstring).

    ValueError when a request (with its adapter, under unified memory) cannot fit the
    pool even alone, or when the separate pool leaves no KV block.
    """
    geom = cost_model.model
    cost = LoRAStepCost.from_roofline(cost_model)
    bs = config.block_size
    block_bytes = bs * geom.kv_bytes_per_token_per_gpu
    link_bps = cost_model.gpu.host_link_bytes_per_s * cost_model.host_link_efficiency
    copy_fixed = geom.num_layers * cost_model.copy_latency_s
    w = workload.requests
    n = len(w)
    base_only = config.memory == "none" or workload.num_adapters == 0
    adapter = np.full(n, -1, np.int64) if base_only else workload.adapter
    n_ad = max(workload.num_adapters, 1)
    a_bytes = np.array([spec.adapter_bytes(geom, a) for a in range(n_ad)], np.float64)
    a_params = a_bytes / geom.bytes_per_param
    a_pages = np.ceil(a_bytes / block_bytes).astype(np.int64)
    slot_bytes = float(a_bytes.max()) if config.memory == "separate" else 0.0
    reserved = config.max_loras * slot_bytes
    kv_blocks = int((config.budget_bytes - reserved) // block_bytes)
    if kv_blocks < 1:
        raise ValueError(
            f"separate adapter pool of {config.max_loras} x {slot_bytes / 2**20:.1f} MiB leaves"
            f" no KV block in a budget of {config.budget_bytes / 2**30:.2f} GiB"
        )
    prompt_len = w.prompt_len.astype(np.int64)
    out_len = w.output_len.astype(np.int64)
    need = -(-(prompt_len + out_len) // bs)
    own = np.where(adapter >= 0, a_pages[np.maximum(adapter, 0)], 0)
    fits = need + (own if config.memory == "unified" else 0)
    too_big = np.flatnonzero(fits > kv_blocks)
    if len(too_big):
        i = int(too_big[0])
        raise ValueError(f"request {i} needs {fits[i]} blocks, the pool has {kv_blocks}")

    free = kv_blocks
    resident: OrderedDict[int, None] = OrderedDict()  # device adapters, LRU first
    users: dict[int, int] = {}  # adapter -> running requests using it
    stats = dict(loads=0, evictions=0, load_bytes=0.0, load_s=0.0, skips=0, steps=0)
    arrival = w.arrival_time.astype(np.float64)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    order = np.argsort(arrival, kind="stable").tolist()
    heap = [(float(arrival[i]), i) for i in order]
    heapq.heapify(heap)
    waiting: deque[int] = deque()
    running: list[_Req] = []
    t = 0.0
    link_free = 0.0
    sync_due = 0.0
    max_batch = 0
    batch_time = 0.0
    busy = 0.0
    done = 0
    dirty = True  # admission can change only after an arrival or a finish

    def evict_one(exclude: int) -> bool:
        nonlocal free
        for a in resident:  # LRU first
            if a != exclude and users.get(a, 0) == 0:
                del resident[a]
                stats["evictions"] += 1
                if config.memory == "unified":
                    free += int(a_pages[a])
                return True
        return False

    def evictable_pages(exclude: int) -> int:
        return sum(int(a_pages[a]) for a in resident if a != exclude and users.get(a, 0) == 0)

    def activate(a: int) -> float:
        """Loads adapter a (now resident); returns when the request may use it."""
        nonlocal link_free, sync_due
        dt = a_bytes[a] / link_bps + copy_fixed
        stats["loads"] += 1
        stats["load_bytes"] += float(a_bytes[a])
        stats["load_s"] += dt
        resident[a] = None
        if config.load == "async":
            link_free = max(link_free, t) + dt
            return link_free
        sync_due += dt
        return t

    def admit() -> None:
        nonlocal free
        skipped: list[int] = []
        while waiting and len(running) < config.max_num_seqs:
            i = waiting.popleft()
            a = int(adapter[i])
            blocks = int(need[i])
            ready = t
            if a < 0 or a in resident:
                if blocks > free:
                    waiting.appendleft(i)
                    break
                if a >= 0:
                    resident.move_to_end(a)
            elif config.memory == "unified":
                want = blocks + int(a_pages[a])
                if want > free + evictable_pages(a):
                    waiting.appendleft(i)
                    break
                while free < want:
                    evict_one(a)
                free -= int(a_pages[a])
                ready = activate(a)
            else:  # separate: KV first (FCFS), then a slot (skip when none frees)
                if blocks > free:
                    waiting.appendleft(i)
                    break
                if len(resident) >= config.max_loras and not evict_one(a):
                    stats["skips"] += 1
                    skipped.append(i)
                    continue
                ready = activate(a)
            free -= blocks
            if a >= 0:
                users[a] = users.get(a, 0) + 1
            running.append(_Req(i, int(prompt_len[i]), int(out_len[i]), blocks, a, ready_at=ready))
        for i in reversed(skipped):  # skipped requests keep their place at the front
            waiting.appendleft(i)

    def lora_work(rows: list[tuple[_Req, int]]) -> tuple[float, float]:
        """(bytes of A/B read, FLOPs) of one step's rows (request, tokens)."""
        if base_only:
            return 0.0, 0.0
        flops = 2.0 * sum(q * a_params[r.adapter] for r, q in rows if r.adapter >= 0)
        if config.kernel == "grouped":
            used = {r.adapter for r, _ in rows if r.adapter >= 0}
            return float(sum(a_bytes[a] for a in used)), flops
        return float(sum(q * a_bytes[r.adapter] for r, q in rows if r.adapter >= 0)), flops

    while done < n:
        while heap and heap[0][0] <= t:
            waiting.append(heapq.heappop(heap)[1])
            dirty = True
        if dirty:
            admit()
            dirty = False
        prefilling = [r for r in running if r.computed < r.prompt and r.ready_at <= t]
        decoding = [r for r in running if r.computed >= r.prompt]
        if not prefilling and not decoding:
            nxt = [r.ready_at for r in running if r.ready_at > t]
            if heap:
                nxt.append(heap[0][0])
            if not nxt:
                raise RuntimeError("simulate_lora: stuck (nothing runs, nothing arrives)")
            t = max(t, min(nxt))
            continue
        nb = len(decoding)
        if prefilling:
            budget = config.max_num_batched_tokens - nb
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
            lb, lf = lora_work(chunks + [(r, 1) for r in decoding])
            dt = float(cost(q_arr.sum(), nb, ctx + s_arr.sum(),
                            float((q_arr * (q_arr + 1) / 2 + q_arr * s_arr).sum()), emits,
                            lb, lf))  # fmt: skip
            dt += sync_due
            sync_due = 0.0
            t += dt
            busy += dt
            batch_time += dt * (nb + len(chunks))
            max_batch = max(max_batch, nb + len(chunks))
            stats["steps"] += 1
            for r in decoding:
                r.out_done += 1
            for r, q in chunks:
                r.computed += q
                if r.computed >= r.prompt:
                    first[r.idx] = t
                    r.out_done = 1
        else:
            # Identical decode steps up to the next event: one numpy expression.
            k_max = min(r.out_len - r.out_done for r in decoding)
            events = [r.ready_at for r in running if r.ready_at > t]
            if heap:
                events.append(heap[0][0])
            ctx = sum(r.prompt + r.out_done for r in decoding)
            lb, lf = lora_work([(r, 1) for r in decoding])
            steps = np.arange(max(k_max, 1), dtype=np.float64)
            cum = np.cumsum(cost(0.0, nb, ctx + nb * steps, 0.0, 0.0, lb, lf))
            k = len(cum)
            if events:
                k = min(k, int(np.searchsorted(cum, min(events) - t)) + 1)
            k = max(k, 1)
            dt = float(cum[k - 1]) + sync_due
            sync_due = 0.0
            t += dt
            busy += dt
            batch_time += dt * nb
            max_batch = max(max_batch, nb)
            stats["steps"] += k
            for r in decoding:
                r.out_done += k
        still = []
        for r in running:
            if r.computed >= r.prompt and r.out_done >= r.out_len:
                finish[r.idx] = t
                free += r.blocks
                if r.adapter >= 0:
                    users[r.adapter] -= 1
                done += 1
                dirty = True
            else:
                still.append(r)
        running[:] = still

    return LoRAResult(
        arrival_s=arrival,
        first_token_s=first,
        finish_s=finish,
        output_tokens=int(out_len.sum()),
        steps=stats["steps"],
        kv_blocks=kv_blocks,
        max_batch=max_batch,
        mean_batch=batch_time / busy if busy > 0 else math.nan,
        loads=stats["loads"],
        evictions=stats["evictions"],
        load_bytes=stats["load_bytes"],
        load_s=stats["load_s"],
        skips=stats["skips"],
        busy_s=busy,
    )
