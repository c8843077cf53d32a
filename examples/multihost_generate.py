"""Generate with one model split over several processes (hosts): run this script once per
process, with the same arguments except ``--process-id``.

    # on host 0
    python examples/multihost_generate.py --coordinator-address host0:12355 \\
        --num-processes 2 --process-id 0 --model tiny-llama-tp --tensor-parallel-size 4
    # on host 1
    python examples/multihost_generate.py --coordinator-address host0:12355 \\
        --num-processes 2 --process-id 1 --model tiny-llama-tp --tensor-parallel-size 4

On one CPU machine, two processes with 2 simulated devices each make the same mesh:
prefix both commands with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and use
``localhost``. Process 0 takes the prompts and prints the outputs; the others follow its
steps until it shuts them down (pagedjax/engine/fronts/multihost.py, docs/parallelism.md).
"""

from __future__ import annotations

import argparse

from pagedjax.engine.fronts import multihost


def main(argv: list[str] | None = None) -> list[str] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--heartbeat-timeout", type=int, default=100, help="seconds")
    ap.add_argument("--model", default="tiny-llama-tp")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("prompts", nargs="*", default=["The capital of France is", "Paged KV"])
    args = ap.parse_args(argv)
    # Before anything else touches JAX: the mesh must see every process's devices.
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id,
                         heartbeat_timeout_s=args.heartbeat_timeout)  # fmt: skip
    import jax

    from pagedjax import LLM, SamplingParams

    tp = args.tensor_parallel_size or len(jax.devices())
    llm = LLM(model=args.model, tensor_parallel_size=tp, max_model_len=256, max_num_seqs=8,
              num_gpu_blocks_override=64, warmup="none")  # fmt: skip
    if not multihost.is_leader():
        llm.follow()  # until process 0 calls shutdown()
        return None
    try:
        outs = llm.generate(args.prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                            use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    texts = [o.outputs[0].text for o in outs]
    for o, text in zip(outs, texts, strict=True):
        print(f"{o.prompt!r} -> {text!r}")
    print(f"process 0 of {jax.process_count()}, tensor_parallel_size={tp} over"
          f" {len(jax.devices())} devices")  # fmt: skip
    return texts


if __name__ == "__main__":
    main()
