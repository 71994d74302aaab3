"""Hashing cost per block for vLLM's four prefix-cache hash functions, at block sizes 16 and 64.

Method: best of 7 runs of 20,000 ``hash_block_tokens`` calls on random 32-byte parents and random
token ids (``kvlab.sim.hash_cost.measure_hash_cost``), plus the bare SHA-256 and xxh3-128 digests of
the same pickled inputs. Saved to ``data/measurements/hashing.json`` with the machine.
"""

from kvlab.capacity.cost_model import cost_model
from kvlab.machine import machine_line, save_measurement
from kvlab.sim.hash_cost import measure_hash_cost

NUMBER, REPEAT = 20_000, 7


def main() -> None:
    rows = measure_hash_cost(block_sizes=(16, 64), number=NUMBER, repeat=REPEAT)
    print(f"hash_block_tokens, µs per block (best of {REPEAT} x {NUMBER} calls) on {machine_line()}")
    print(f"{'hash function':<22}{'block 16':>10}{'block 64':>10}")
    for name in dict.fromkeys(r["hash_fn"] for r in rows):
        cells = {r["block_size"]: r["seconds_per_block"] * 1e6 for r in rows if r["hash_fn"] == name}
        print(f"{name:<22}{cells[16]:>10.2f}{cells[64]:>10.2f}")
    for model in ("llama-3-8b", "llama-3-70b"):
        cost = cost_model(model, "H100-SXM-80GB")
        print(f"prefill of one 16-token block, {model}, one {cost.gpu.name} at {cost.prefill_mfu:.0%} of its "
              f"{cost.gpu.bf16_dense_tflops:g} TFLOP/s dense BF16 peak (modelled): "
              f"{cost.prefill_seconds(16) * 1e6:,.0f} µs of compute")
    path = save_measurement(
        "hashing", rows,
        method=f"kvlab.sim.hash_cost.measure_hash_cost(block_sizes=(16, 64), number={NUMBER}, repeat={REPEAT}): "
               "best-of-repeat seconds per hash_block_tokens call, random 32-byte parents, token ids < 32000",
    )
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
