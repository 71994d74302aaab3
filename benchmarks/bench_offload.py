"""How fast the CPU tier's block copies run on this machine, where both tiers are host memory.

Method: Llama-3-8B-shaped KV caches (32 layers of K and V, blocks of 16 tokens x 8 KV heads x
128 dimensions in bf16: 2 MiB per block over all layers) with 256 blocks on the "GPU" side
and 256 on the CPU side, both host tensors. Time ``kvlab.core.kv_offload.transfer_blocks`` copying
64 blocks at scattered ids one way and back with ``time.perf_counter``, best of 7 (noise on
a shared machine only adds time), and report bytes per second. This is host memory
bandwidth through PyTorch's indexed copy, not a PCIe transfer: on a GPU machine the same
call crosses the link and the cost model's figure applies instead.
"""

import torch

from kvlab.engine.kv_offload import allocate_cpu_kv_caches, transfer_blocks
from kvlab.machine import machine_line, save_measurement

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 32, 16, 8, 128
NUM_BLOCKS, NUM_COPIES, REPEAT = 256, 64, 7


def main() -> None:
    import time

    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    gpu = [(torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)) for _ in range(LAYERS)]
    cpu = allocate_cpu_kv_caches(gpu, NUM_BLOCKS)
    bytes_per_block = 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_SIZE * 2
    pairs = [(7 * i % NUM_BLOCKS, 11 * i % NUM_BLOCKS) for i in range(NUM_COPIES)]
    results = {}
    for name, src, dst in (("gpu_to_cpu", gpu, cpu), ("cpu_to_gpu", cpu, gpu)):
        best = float("inf")
        for _ in range(REPEAT):
            start = time.perf_counter()
            transfer_blocks(src, dst, pairs)
            best = min(best, time.perf_counter() - start)
        results[name] = {"blocks": NUM_COPIES, "seconds": round(best, 6),
                         "bytes_per_s": round(NUM_COPIES * bytes_per_block / best)}
    results["bytes_per_block"] = bytes_per_block
    print(f"machine: {machine_line()}")
    print(f"{NUM_COPIES} blocks of {bytes_per_block // 2**20} MiB (Llama-3-8B shape, bf16, block 16), best of {REPEAT}")
    for name in ("gpu_to_cpu", "cpu_to_gpu"):
        r = results[name]
        print(f"  {name:11s} {r['seconds'] * 1000:8.2f} ms   {r['bytes_per_s'] / 1e9:6.2f} GB/s")
    path = save_measurement("offload_copy", results, method=" ".join(__doc__.split("\n\n")[1].split()))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
