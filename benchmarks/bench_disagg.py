"""Colocated against disaggregated serving: TTFT and inter-token latency as prompt length and load grow, measured on
this machine's CPU engines and modelled for a GPU.

Method: measured, the tiny trained Llama (``data/tiny-pydoc-llama``, float32, torch attention, one torch thread)
served by real ``LLMEngine`` objects on per-engine clocks (``kvlab.sim.disaggregation``): colocated on two
replicas (round robin), or 1P1D through ``P2pGlooConnector`` over gloo on 127.0.0.1. Each engine's clock
advances by the CPU seconds of its steps (``time.process_time``, so other work on a shared machine does not
count), a decode engine with nothing but pulls to wait for adds each pull's measured seconds. 24 requests per
point, Poisson arrivals and random prompts (a new seed per point, so no prefix hits across points), 16 output
tokens, prompts of 64 to 448 tokens at 10 and 40 requests per second, after one warm-up request through the
pair. Modelled: the same driver over kvlab's scheduler with no model, each step's seconds from
``kvlab.capacity.disaggregation.step_seconds`` (Llama-3-8B on an H100-SXM-80GB, BF16, 50 % MFU assumed), the
KV crossing InfiniBand NDR 400G, 48 requests of 64 output tokens, prompts of 512 to 8192 tokens at 2 to 16
requests per second. Percentiles are over the requests' first tokens (TTFT) and over every gap between two
tokens (ITL).
"""

from __future__ import annotations

import time

import torch

from kvlab.capacity.cost_model import cost_model
from kvlab.capacity.disaggregation import kv_transfer_bytes, transfer_seconds
from kvlab.data import TINY_MODEL_DIR
from kvlab.machine import machine_line, save_measurement
from kvlab.sim.disaggregation import ModelledEngine, PDWorkload, serve_colocated, serve_disaggregated

ENGINE = {"num_gpu_blocks": 512, "block_size": 16, "max_num_batched_tokens": 256, "dtype": "float32",
          "max_model_len": 512}
MEASURED = [(p, r) for p in (64, 192, 448) for r in (10.0, 40.0)]
MODELLED = [(p, r) for p in (512, 2048, 8192) for r in (2.0, 8.0, 16.0)]


def _ms(summary: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1000, 2) for k, v in summary.items()}


def measured() -> list[dict]:
    from kvlab.engine import LLMEngine
    from kvlab.engine.kv_transfer_config import KVTransferConfig
    from kvlab.fleet.disagg import DisaggProxy, MeasuredEngine

    torch.set_num_threads(1)  # one core per engine: CPU seconds then mean the same thing in every step
    config = {role: KVTransferConfig("P2pGlooConnector", kv_role=role, kv_port=0)
              for role in ("kv_producer", "kv_consumer")}
    prefill = LLMEngine(TINY_MODEL_DIR, **ENGINE, kv_transfer_config=config["kv_producer"])
    decode = LLMEngine(TINY_MODEL_DIR, **ENGINE, kv_transfer_config=config["kv_consumer"])
    replicas = [LLMEngine(TINY_MODEL_DIR, **ENGINE) for _ in range(2)]
    rows = []
    try:
        DisaggProxy(prefill, decode).generate([list(range(1, 40))], max_tokens=2)  # the handshake, once
        pulls = decode.kv_connector_worker.connector_worker.pull_seconds
        for k, (prompt, rate) in enumerate(MEASURED):
            workload = PDWorkload(prompt_tokens=prompt, output_tokens=16, rate=rate, num_requests=24, seed=k)
            engines = iter(replicas)
            colocated = serve_colocated(lambda it=engines: MeasuredEngine(next(it)), workload, id_prefix=f"c{k}-")
            apart = serve_disaggregated(lambda: MeasuredEngine(prefill),
                                        lambda: MeasuredEngine(decode, peer=prefill), workload, id_prefix=f"d{k}-")
            while prefill.has_requests():
                prefill.step()
            moved = [pulls[r] for r in apart.first_token if r in pulls]
            rows.append({"prompt_tokens": prompt, "rate": rate, "colocated_ms": _ms(colocated.summary()),
                         "disaggregated_ms": _ms(apart.summary()),
                         "pull_ms_mean": round(1000 * sum(moved) / max(len(moved), 1), 2),
                         "bytes_per_request": prompt // 16 * prefill.bytes_per_block + (
                             prefill.bytes_per_block if prompt % 16 else 0)})
            print(f"  measured  P={prompt:4d} rate={rate:5.1f}/s  colocated {rows[-1]['colocated_ms']}\n"
                  f"                               disaggregated {rows[-1]['disaggregated_ms']}  "
                  f"pull {rows[-1]['pull_ms_mean']} ms")
    finally:
        prefill.shutdown()
        decode.shutdown()
    return rows


def modelled() -> list[dict]:
    cost = cost_model("llama-3-8b", "H100-SXM-80GB", "InfiniBand NDR 400G")
    rows = []
    for prompt, rate in MODELLED:
        workload = PDWorkload(prompt_tokens=prompt, output_tokens=64, rate=rate, num_requests=48, seed=0)
        colocated = serve_colocated(lambda: ModelledEngine(cost, max_num_batched_tokens=2048), workload)
        apart = serve_disaggregated(lambda: ModelledEngine(cost, max_num_batched_tokens=2048),
                                    lambda: ModelledEngine(cost), workload, lambda n: transfer_seconds(cost, n))
        rows.append({"prompt_tokens": prompt, "rate": rate, "colocated_ms": _ms(colocated.summary()),
                     "disaggregated_ms": _ms(apart.summary()),
                     "bytes_per_request": kv_transfer_bytes("llama-3-8b", prompt)})
        print(f"  modelled  P={prompt:5d} rate={rate:5.1f}/s  colocated {rows[-1]['colocated_ms']}\n"
              f"                                disaggregated {rows[-1]['disaggregated_ms']}")
    return rows


def main() -> None:
    print(f"machine: {machine_line()}")
    started = time.perf_counter()
    results = {"measured_cpu": measured(), "modelled_gpu": modelled(),
               "modelled_setup": "Llama-3-8B on H100-SXM-80GB (BF16, prefill_mfu 0.5), KV over InfiniBand NDR 400G; "
                                 "colocated: 2 replicas; disaggregated: 1 prefill + 1 decode GPU",
               "measured_setup": "tiny-pydoc-llama float32 on this CPU, one torch thread; colocated: 2 replicas; "
                                 "disaggregated: 1P1D over P2pGlooConnector (gloo, 127.0.0.1)"}
    print(f"({time.perf_counter() - started:.0f} s)")
    path = save_measurement("disagg_serving", results, method=" ".join(__doc__.split("\n\n")[1].split()))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
