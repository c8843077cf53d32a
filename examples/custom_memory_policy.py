"""Ablation (c): a memory policy of our own vs the paged one, simulated. ``Lookahead`` takes
``ahead`` extra blocks whenever a sequence needs one (no watermark); the scheduler runs any
object with pagedjax.memory.policy.MemoryPolicy's methods. Run with --tiny for CI."""

import dataclasses
import sys

import jax.numpy as jnp
from jax import lax

import pagedjax as pj
from pagedjax.memory.policy import MemoryUsage


@dataclasses.dataclass(frozen=True)
class Lookahead:
    max_seqs: int
    capacity_tokens: int
    block_size: int = 16
    ahead: int = 2

    def init_state(self):  # (blocks held per sequence int32[max_seqs], free blocks int32[])
        free = jnp.int32(self.capacity_tokens // self.block_size)
        return jnp.zeros((self.max_seqs,), jnp.int32), free

    def grow(self, state, seq_ids, new_lens, final_lens, max_lens, mask, use_watermark):
        (held, free), want = state, -(-new_lens // self.block_size)
        need = jnp.where(want > held[seq_ids], want + self.ahead - held[seq_ids], 0)
        def serve(free, x):  # in array order, each all or nothing (the policy contract)
            ok = ~x[1] | (x[0] <= free)
            return free - jnp.where(x[1] & ok, x[0], 0), ok

        free, ok = lax.scan(serve, free, (need, mask))
        return (held.at[seq_ids].add(jnp.where(mask & ok, need, 0)), free), ok

    def release(self, state, seq_ids, mask):
        (held, free), back = state, jnp.sum(state[0][seq_ids] * mask)
        return held.at[seq_ids].multiply(~mask), free + back

    def usage(self, state, lens, final_lens, live):
        held = jnp.where(live, state[0] * self.block_size, 0).astype(jnp.float32)
        tokens = jnp.sum(jnp.minimum(jnp.where(live, lens, 0), held))
        cap, used, zero = jnp.float32(self.capacity_tokens), jnp.sum(held), jnp.float32(0)
        return MemoryUsage(tokens, zero, used - tokens, cap - used, cap)


def main(tiny: bool = False) -> dict:
    w = pj.make_workload("sharegpt", 2.0 if tiny else 3.0, duration_s=30 if tiny else 300)
    policy, cfg = pj.build_system("paged")  # its block size is 16, as Lookahead's
    mine = Lookahead(cfg.max_seqs, policy.capacity_tokens)
    out = {n: pj.simulate_system((p, cfg), w).metrics() for n, p in [("paged", policy),
                                                                     ("lookahead", mine)]}
    for name, m in out.items():
        print(f"{name:<9} {m['norm_latency_s_per_token']:.3f} s/token, {m['preemptions']} preempts")
    return out


if __name__ == "__main__":
    main("--tiny" in sys.argv)
