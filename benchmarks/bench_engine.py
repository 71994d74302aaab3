"""kvlab's engine against transformers.generate: generated tokens per second on the tiny seeded Llama.

Method: ``kvlab.engine.evaluation.measure_throughput`` on a freshly written ``save_tiny_llama``
checkpoint (2 layers, 4 query / 2 KV heads of 16, float32), 5 prompts of 12-36 tokens, 8 greedy
tokens each with EOS ignored, after an untimed one-token warm-up of each side; kvlab batches the
prompts in one engine (64 blocks of 16 tokens), transformers runs ``generate`` on each prompt in
turn. Kernel time is summed over every ``reshape_and_cache`` / ``paged_attention`` call. Saved to
``data/measurements/engine_throughput.json``. On a CPU the kernels run in Triton's interpreter:
the figures measure the interpreter, not paging.
"""

import tempfile
from pathlib import Path

from kvlab.engine import save_tiny_llama
from kvlab.engine.evaluation import measure_throughput
from kvlab.engine.toy import random_token_ids
from kvlab.machine import machine_line, save_measurement

PROMPT_LENGTHS, MAX_TOKENS = (12, 18, 24, 30, 36), 8


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_llama(Path(tmp) / "tiny-llama")
        prompts = [random_token_ids(n, seed=500 + n) for n in PROMPT_LENGTHS]
        result = measure_throughput(model_dir, prompts, MAX_TOKENS, num_gpu_blocks=64)
    ratio = result["kvlab_tokens_per_s"] / result["hf_tokens_per_s"]
    print(f"tiny Llama, {len(prompts)} prompts x {MAX_TOKENS} tokens, on {machine_line()}")
    print(f"kvlab ({result['kernel_backend']}): {result['kvlab_tokens_per_s']:.1f} tokens/s, "
          f"{result['kernel_share']:.0%} of it in {result['kernel_calls']} kernel calls")
    print(f"transformers.generate: {result['hf_tokens_per_s']:.1f} tokens/s; kvlab / transformers = {ratio:.2f}")
    path = save_measurement("engine_throughput", result, method=__doc__.split("Method: ", 1)[1].strip())
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
