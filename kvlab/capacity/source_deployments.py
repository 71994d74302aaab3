"""The source articles' three worked deployments, as data, with their arithmetic redone exactly.

Each ``SourceDeployment`` keeps what the article printed (its command, figures and units) beside
a ``kvlab.capacity.playbook.Deployment`` that kvlab plans exactly; ``reproduce`` and
``comparison_rows`` put the two side by side for notebook 07.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from kvlab._validate import checked, one_of
from kvlab.capacity.hardware import GB
from kvlab.capacity.playbook import Deployment, Workload, plan_deployment
from kvlab.errors import UnknownNameError
from kvlab.units import GiB, KiB, format_bytes


@dataclasses.dataclass(frozen=True)
class SourceDeployment:
    """A worked deployment from the source material: its settings, its own figures, and our exact reading."""

    key: str
    title: str
    command: str
    deployment: Deployment
    workload: Workload
    kv_budget: float  # the KV memory the source arrives at, in its unit (all GPUs of the instance)
    budget_unit: Literal["GB", "GiB"]  # what its arithmetic divides in: decimal or binary
    kv_per_token_kib: float  # the bytes per token it assumes (whole model, all GPUs), in its unit / 1024 or 1000
    source_figures: Mapping[str, str]  # what it prints
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SourceArithmetic:
    """The source material's own division, redone exactly in the unit it used."""

    tokens: float
    max_concurrency: float
    typical_concurrency: float


@checked
def source_arithmetic(source: SourceDeployment) -> SourceArithmetic:
    """Budget / bytes per token / lengths, in the source's unit, with no blocks and no rounding."""
    unit = GB if source.budget_unit == "GB" else GiB
    per_token = source.kv_per_token_kib * (1000 if source.budget_unit == "GB" else KiB)
    tokens = source.kv_budget * unit / per_token
    return SourceArithmetic(tokens, tokens / source.deployment.max_model_len,
                            tokens / source.workload.typical_tokens)


SOURCE_DEPLOYMENTS: Mapping[str, SourceDeployment] = {
    "a": SourceDeployment(
        key="a", title="(a) an 8B model on one 48 GB L40S, chat",
        command="vllm serve Qwen/Qwen3-8B --max-model-len 8192 --gpu-memory-utilization 0.92",
        deployment=Deployment("qwen3-8b", "L40S", max_model_len=8192, gpu_memory_utilization=0.92,
                              non_kv_gib=6 * GB / GiB),
        workload=Workload(mean_prompt_tokens=1000, mean_output_tokens=500),
        kv_budget=22, budget_unit="GB", kv_per_token_kib=128,
        source_figures={"weights": "16 GB", "overhead": "6 GB", "KV pool": "about 22 GB", "tokens": "about 172K",
                        "max_concurrency": "21x", "typical": "100+"},
        notes=("The source's 172K tokens is 22 x 10^9 B / 128 x 10^3 B: decimal units, and 128 KB per token, "
               "which is Llama-3-8B's figure. Qwen3-8B has 36 layers, not 32: 144 KiB per token.",
               "An L40S labelled 48 GB reports 46,068 MiB (44.99 GiB), not 48 GiB.",
               "The source gives only the mean total, 1.5K tokens; the 1,000 + 500 split is ours and changes "
               "nothing without a shared prefix."),
    ),
    "b": SourceDeployment(
        key="b", title="(b) a 70B FP8 model on 4 x H100, RAG",
        command=("vllm serve <70B-FP8> --tensor-parallel-size 4 --max-model-len 32768 --kv-cache-dtype fp8 "
                 "--gpu-memory-utilization 0.93 --max-num-batched-tokens 16384"),
        deployment=Deployment("llama-3.1-70b", "H100-SXM-80GB", max_model_len=32768, tp=4, kv_dtype="fp8",
                              gpu_memory_utilization=0.93, weights_dtype="fp8",
                              non_kv_gib=(80 * 0.93 - 70 / 4 - 50) * GB / GiB),
        workload=Workload(mean_prompt_tokens=20_000, mean_output_tokens=500),
        kv_budget=200, budget_unit="GiB", kv_per_token_kib=160,
        source_figures={"weights": "70 GB / 4 = 17.5 GB per GPU", "KV pool": "about 50 GB per GPU, 200 GB in all",
                        "tokens": "1.3M", "max_concurrency": "40x"},
        notes=("Here the source divides in binary units: 200 GiB / 160 KiB = 1,310,720 tokens, exactly 40 "
               "requests of 32,768. 160 KiB is the whole model's FP8 KV per token; each of the 4 GPUs holds "
               "a quarter (40 KiB) and a quarter of the pool, so the per-GPU view gives the same count.",
               "The source does not name the model; we read it as Llama-3.1-70B with FP8 weights, whose config "
               "allows 131,072 positions (Llama-3-70B's stops at 8,192). Both store the same 320 KiB per token "
               "in bf16.",
               "The non-KV memory (6.9 GB per GPU) is what the source's own subtraction leaves: "
               "80 x 0.93 - 17.5 - 50.",
               "The source states only the 20K-token prompts; the 500-token answers are ours."),
    ),
    "c": SourceDeployment(
        key="c", title="(c) a 32B model on 2 x A100 80GB, long documents",
        command=("vllm serve <32B> --tensor-parallel-size 2 --max-model-len 131072 --gpu-memory-utilization 0.95 "
                 "--max-num-seqs 16"),
        deployment=Deployment("qwen2.5-32b-instruct", "A100-80GB", max_model_len=131072, tp=2, kv_dtype="bf16",
                              gpu_memory_utilization=0.95, non_kv_gib=(80 * 0.95 - 64 / 2 - 40) * GB / GiB),
        workload=Workload(mean_prompt_tokens=100_000, mean_output_tokens=1000),
        kv_budget=80, budget_unit="GB", kv_per_token_kib=160,
        source_figures={"weights": "64 GB / 2 = 32 GB per GPU", "KV pool": "about 40 GB per GPU, 80 GB in all",
                        "tokens": "500K", "max_concurrency": "3.8x"},
        notes=("The source assumes 160 KB per token and divides in decimal units: 80 x 10^9 / 160 x 10^3 = "
               "500,000. Qwen2.5-32B's config (64 layers, 8 KV heads of 128, bf16) gives 256 KiB per token: "
               "the real concurrency is about two thirds of the source's.",
               "Qwen2.5-32B-Instruct's config says max_position_embeddings 32768: serving 131,072 tokens needs "
               "its YaRN rope scaling (factor 4) configured, or vLLM refuses to start.",
               "The A100 has no FP8 tensor cores, which is why the source keeps the KV cache in 16 bits.",
               "The non-KV memory (4 GB per GPU) is what the source's subtraction leaves: 80 x 0.95 - 32 - 40."),
    ),
}


@checked
def reproduce(key: str) -> dict[str, Any]:
    """One source deployment side by side: its printed figures, its arithmetic redone, and kvlab's exact plan."""
    source = SOURCE_DEPLOYMENTS[one_of("key", key, SOURCE_DEPLOYMENTS)]
    result = plan_deployment(source.deployment, source.workload)
    return {"source": source, "arithmetic": source_arithmetic(source), "exact": result}


@checked
def comparison_rows(keys: Sequence[str] = ("a", "b", "c")) -> list[dict[str, Any]]:
    """One row per source deployment: the source's figures beside the exact ones (for the notebook's table)."""
    rows = []
    for i, key in enumerate(keys):
        if key not in SOURCE_DEPLOYMENTS:
            raise UnknownNameError(f"keys[{i}]", key, SOURCE_DEPLOYMENTS)
        r = reproduce(key)
        source, arithmetic, exact = r["source"], r["arithmetic"], r["exact"]
        plan = exact.plan
        rows.append({
            "deployment": source.title,
            "source: KV per token": f"{source.kv_per_token_kib:g} {'KB' if source.budget_unit == 'GB' else 'KiB'}",
            "exact: KV per token (all GPUs)": format_bytes(plan.kv_bytes_per_token * source.deployment.tp),
            "source: tokens": source.source_figures["tokens"],
            "source arithmetic: tokens": f"{arithmetic.tokens:,.0f}",
            "exact: tokens (vLLM log)": f"{plan.num_blocks * plan.block_size:,}",
            "source: concurrency": source.source_figures["max_concurrency"],
            "source arithmetic: concurrency": f"{arithmetic.max_concurrency:.2f}x",
            "exact: concurrency (vLLM log)": f"{plan.max_concurrency:.2f}x",
            "exact: typical requests at once": exact.concurrency_typical,
        })
    return rows
