"""What torchrun runs: ``torchrun --nproc-per-node 2 -m kvlab.engine.launch MODEL_DIR --prompt 1,2,3``.

Every process torchrun starts runs ``main``: rank 0 builds ``LLMEngine(MODEL_DIR,
tensor_parallel_size=WORLD_SIZE, distributed_executor_backend="external_launcher")``, generates greedily
for each ``--prompt`` (token ids, comma-separated) and prints one JSON line (the tokens, and each rank's KV
cache as allocated); every other rank runs ``kvlab.engine.worker.worker_main``, the same entry point the
ranks ``LLMEngine(..., tensor_parallel_size=N)`` spawns itself run. Across machines the same command runs
with ``--nnodes`` and a rendezvous address; nothing here assumes one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.engine.launch", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--prompt", action="append", required=True, help="token ids, comma-separated; repeatable")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-gpu-blocks", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default="torch")
    args = parser.parse_args(argv)
    if os.environ.get("RANK", "0") != "0":
        from kvlab.engine.worker import worker_main

        worker_main()  # exits the process when rank 0 says shutdown
        return
    from kvlab.engine.llm_engine import LLMEngine

    prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
    engine = LLMEngine(args.model_dir, tensor_parallel_size=int(os.environ.get("WORLD_SIZE", "1")),
                       distributed_executor_backend="external_launcher", num_gpu_blocks=args.num_gpu_blocks,
                       dtype=args.dtype, attention_backend=args.attention_backend)
    try:
        tokens = engine.generate(prompts, max_tokens=args.max_tokens)
        print(json.dumps({"tokens": tokens, "kv_cache_reports": engine.kv_cache_reports}), flush=True)
    finally:
        engine.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
