"""Pipeline parallelism's step time and bubble, on top of the roofline (``cost_model.py``).

A model is split into PP stages of TP GPUs each (pagedjax/model/pipeline.py). One step of
one batch runs the stages in turn, with the activations [new tokens, hidden] sent from
each stage to the next over a link (``LINK_BYTES_PER_S``: NVLink inside a node, PCIe, or
an inter-node network). Pure arithmetic (float, no JAX), for tables:

- ``stage_time``: the largest stage priced as a model of that many layers *with* the LM
  head and embedding (the last stage's extra work): a bound on the slowest stage.
- ``transfer_time``: one stage-to-stage send: bytes / (efficiency x link) + latency.
- ``PipelineStep``: with ``in_flight`` = m batches (m <= PP; pagedjax runs 1, vLLM runs
  PP), a batch's step latency is PP x stage + (PP - 1) x transfer + the fixed overhead,
  and the pipeline finishes m batches per (PP x (stage + transfer)) in steady state: each
  GPU is busy m / PP of the time, the bubble is (PP - m) / PP. This is vLLM's scheme
  (PP scheduler batches in flight *across* steps); pagedjax does not build it.
- ``MicrobatchStep`` (what pagedjax builds, ``pipeline_microbatches`` = M): one step's
  tokens split into M micro-batches that flow through the stages in M + PP - 1
  ticks (GPipe inside the step); a tick prices one stage over 1 / M of the step's work
  plus one send of 1 / M of its activations; the pipeline drains every step (the next
  step's tokens are this step's samples), so the bubble is (PP - 1) / (M + PP - 1), not 0.

A simulated number is a model, never a measurement (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedjax.simulator.cost_model import RooflineCostModel

# One direction, per GPU: NVLink 4 (H100: 900 GB/s both ways), PCIe 5.0 x16, and an
# inter-node NIC of 400 Gb/s (one NDR InfiniBand / 400G Ethernet port per GPU).
LINK_BYTES_PER_S = {"nvlink": 450e9, "pcie": 64e9, "internode": 50e9}
LINK_LATENCY_S = {"nvlink": 10e-6, "pcie": 15e-6, "internode": 30e-6}


def stage_layers(num_layers: int, pp: int) -> int:
    """Layers of the largest stage under vLLM's even split (ceil(L / PP))."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp must be in [1, {num_layers}], got {pp}")
    return -(-num_layers // pp)


def stage_time(cost: RooflineCostModel, pp: int, prefill_tokens: float, decode_seqs: float,
               kv_tokens: float) -> float:  # fmt: skip
    """Seconds the slowest stage computes one step (roofline of ceil(L / PP) layers plus
    the head, its TP all-reduces included, the host's per-step and per-sequence overhead
    excluded: ``host_time``, paid once per step)."""
    m = cost.model
    stage = replace(cost, model=replace(m, num_layers=stage_layers(m.num_layers, pp)))
    t = stage(prefill_tokens, decode_seqs, kv_tokens)
    return float(t) - host_time(cost, decode_seqs)


def host_time(cost: RooflineCostModel, decode_seqs: float) -> float:
    """The host's seconds of one step: the per-step overhead plus the per-sequence one
    (``seq_overhead_s``, 0 in the plain roofline) for its decode sequences."""
    return cost.step_overhead_s + cost.seq_overhead_s * decode_seqs


def transfer_time(cost: RooflineCostModel, new_tokens: float, link: str,
                  efficiency: float = 0.7) -> float:  # fmt: skip
    """One stage-to-stage send of [new_tokens, hidden] activations over ``link``."""
    if link not in LINK_BYTES_PER_S:
        raise ValueError(f"link must be one of {sorted(LINK_BYTES_PER_S)}, got {link!r}")
    m = cost.model
    sent = new_tokens * m.hidden * m.bytes_per_param
    return sent / (efficiency * LINK_BYTES_PER_S[link]) + LINK_LATENCY_S[link]


@dataclass(frozen=True)
class PipelineStep:
    """One step's pricing at PP stages (see the module docstring)."""

    pp: int
    stage_s: float
    transfer_s: float
    overhead_s: float

    def latency(self) -> float:
        """Seconds from a batch's start to its logits."""
        return self.pp * self.stage_s + (self.pp - 1) * self.transfer_s + self.overhead_s

    def throughput_steps_per_s(self, in_flight: int = 1) -> float:
        """Batches finished per second in steady state with ``in_flight`` batches."""
        if not 1 <= in_flight <= self.pp:
            raise ValueError(f"in_flight must be in [1, {self.pp}], got {in_flight}")
        if in_flight == 1:
            return 1.0 / self.latency()
        cycle = self.pp * (self.stage_s + self.transfer_s) + self.overhead_s
        return in_flight / cycle

    def bubble(self, in_flight: int = 1) -> float:
        """Share of GPU time a stage waits: (PP - m) / PP."""
        if not 1 <= in_flight <= self.pp:
            raise ValueError(f"in_flight must be in [1, {self.pp}], got {in_flight}")
        return (self.pp - in_flight) / self.pp


@dataclass(frozen=True)
class MicrobatchStep:
    """One step of M micro-batches at PP stages (the module docstring): ``tick_stage_s``
    and ``tick_transfer_s`` are one stage's compute and one send for one micro-batch."""

    pp: int
    microbatches: int
    tick_stage_s: float
    tick_transfer_s: float
    overhead_s: float

    @property
    def ticks(self) -> int:
        return self.microbatches + self.pp - 1

    def latency(self) -> float:
        """Seconds of the step: M + PP - 1 ticks, a send after all but the last; equal to
        ``PipelineStep.latency`` at M = 1."""
        return (self.ticks * self.tick_stage_s + (self.ticks - 1) * self.tick_transfer_s
                + self.overhead_s)  # fmt: skip

    def bubble(self) -> float:
        """Share of a stage's ticks it waits: (PP - 1) / (M + PP - 1)."""
        return (self.pp - 1) / self.ticks


def microbatch_step(cost: RooflineCostModel, pp: int, microbatches: int,
                    prefill_tokens: float, decode_seqs: float, kv_tokens: float,
                    link: str = "nvlink") -> MicrobatchStep:  # fmt: skip
    """The step of ``cost``'s model at ``pp`` stages with the step's work split evenly into
    ``microbatches`` groups (pagedjax's ``pipeline_microbatches``: ``model/pipeline.py``
    cuts the step's tokens into equal ranges, the last one shorter; the KV read is taken
    as evenly split too, exact for decode, an approximation for mixed steps)."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    m = float(microbatches)
    work = (prefill_tokens / m, decode_seqs / m, kv_tokens / m)
    return MicrobatchStep(
        pp=pp,
        microbatches=microbatches,
        tick_stage_s=stage_time(cost, pp, *work),
        tick_transfer_s=transfer_time(cost, work[0] + work[1], link) if pp > 1 else 0.0,
        overhead_s=host_time(cost, decode_seqs),
    )


def pipeline_step(cost: RooflineCostModel, pp: int, prefill_tokens: float, decode_seqs: float,
                  kv_tokens: float, link: str = "nvlink") -> PipelineStep:  # fmt: skip
    """The step of ``cost``'s model (its TP inside each stage) split into ``pp`` stages."""
    new_tokens = prefill_tokens + decode_seqs
    return PipelineStep(
        pp=pp,
        stage_s=stage_time(cost, pp, prefill_tokens, decode_seqs, kv_tokens),
        transfer_s=transfer_time(cost, new_tokens, link) if pp > 1 else 0.0,
        overhead_s=host_time(cost, decode_seqs),
    )


__all__ = ["LINK_BYTES_PER_S", "MicrobatchStep", "PipelineStep", "host_time", "microbatch_step",
           "pipeline_step", "stage_layers", "stage_time", "transfer_time"]  # fmt: skip
