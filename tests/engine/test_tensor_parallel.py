"""Tensor parallelism across processes: the same tokens at TP=2 as at TP=1 and in transformers, each rank's KV
bytes as kvlab.capacity counts them, the collectives a step makes, refused shapes, a failing rank, a clean exit.

Each engine here starts two rank processes (a few seconds); one engine per model serves every check on it,
and the last check on an engine may kill it (a fault, a shutdown).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.capacity.tp_cost import tp_step_collectives
from kvlab.data import DATA_DIR
from kvlab.engine import LLMEngine, evaluation
from kvlab.engine.linear import qkv_partition
from kvlab.engine.multiproc_executor import get_open_port
from kvlab.engine.tensor_parallel import (
    formula_bytes_per_token,
    rank_bytes_per_token,
    serve,
    shared_prefix_prompts,
    step_collectives,
)
from kvlab.engine.toy import random_token_ids, save_tiny_llama
from kvlab.errors import KvlabValueError, RankFailedError

TRAINED = DATA_DIR / "tiny-pydoc-llama"
#: Small enough to preempt, chunk and hit: 4 prompts sharing 32 tokens, a budget of 32 tokens, 14 blocks.
TIGHT = dict(num_gpu_blocks=14, max_num_batched_tokens=32, block_size=16, dtype="float32", attention_backend="torch")


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as gone), read from /proc as ps does."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children() -> set[int]:
    """This process's children as ``ps --ppid`` lists them (the ``ps`` itself left out)."""
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if line.split()[1:] != ["ps"]}


def same_run(a, b):
    return (a.outputs, a.prefix_hit_tokens, a.partial_prefill_chunks, a.preemptions) == \
        (b.outputs, b.prefix_hit_tokens, b.partial_prefill_chunks, b.preemptions)


# ----------------------------------------------------------------- the trained model (Hkv = 2 = tp)


@pytest.fixture(scope="module")
def trained_tp2():
    engine = LLMEngine(TRAINED, tensor_parallel_size=2, **TIGHT)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def trained_prompts():
    return shared_prefix_prompts(4096)


def test_the_trained_model_generates_the_same_tokens_on_two_ranks_as_on_one_and_in_transformers(
        trained_tp2, trained_prompts):
    one = serve(LLMEngine(TRAINED, **TIGHT), trained_prompts, max_tokens=12)
    two = serve(trained_tp2, trained_prompts, max_tokens=12)
    assert same_run(one, two)
    assert two.prefix_hit_tokens > 0 and two.partial_prefill_chunks > 0 and two.preemptions > 0  # all three paths
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TRAINED, dtype=torch.float32).eval()
    assert two.outputs == [evaluation.hf_greedy(hf, p, 12) for p in trained_prompts]


def test_each_rank_allocates_half_the_kv_of_one_gpu_as_the_formula_says(trained_tp2):
    spec, tp = trained_tp2.config.spec, 2
    measured = rank_bytes_per_token(trained_tp2)
    assert measured == [formula_bytes_per_token(trained_tp2)] * tp == [kv_bytes_per_token(spec, "fp32", tp)] * tp
    assert measured[0] * 2 == kv_bytes_per_token(spec, "fp32", 1)  # Hkv 2 over 2 ranks: one head each
    assert {r["num_blocks"] for r in trained_tp2.kv_cache_reports} == {trained_tp2.num_gpu_blocks}


def test_a_decode_step_makes_two_all_reduces_per_layer_plus_the_embedding_and_one_logits_gather(trained_tp2):
    ids = [trained_tp2.add_request(random_token_ids(5, s, 4096), max_tokens=3) for s in (1, 2)]
    trained_tp2.step()  # the prefill
    _, stats = step_collectives(trained_tp2)  # a decode step of 2 sequences
    expected = tp_step_collectives(trained_tp2.config.spec, 2, num_seqs=2, activation_dtype="fp32")
    for rank in stats:
        assert (rank.all_reduce_calls, rank.all_gather_calls) == (expected.all_reduces, expected.all_gathers) == (9, 1)
        assert rank.all_reduce_bytes + rank.all_gather_bytes == expected.payload_bytes
    while trained_tp2.has_unfinished_requests():
        trained_tp2.step()
    assert all(trained_tp2.finish_reasons[i] for i in ids)


def test_a_rank_that_raises_mid_step_is_reported_every_rank_stops_and_nothing_hangs(trained_tp2):
    pids = trained_tp2.rank_executor.pids
    trained_tp2.rank_executor.inject_fault(1, "raise")
    trained_tp2.add_request(random_token_ids(8, 3, 4096), max_tokens=2)
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 failed: InjectedFault") as failure:
        trained_tp2.step()
    assert failure.value.rank == 1 and time.monotonic() - started < 20
    assert not any(alive(p) for p in pids) and not children() & set(pids)
    with pytest.raises(RankFailedError):  # the engine is dead: the next step says so at once
        trained_tp2.generate([[5, 6, 7]], max_tokens=1)


# ----------------------------------------------------------------- Hkv = 1 < tp: the KV head replicated


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-mqa"), num_key_value_heads=1)


@pytest.fixture(scope="module")
def mqa_tp2(mqa_dir):
    engine = LLMEngine(mqa_dir, tensor_parallel_size=2, distributed_timeout_seconds=3, **TIGHT)
    yield engine
    engine.shutdown()


def test_one_kv_head_on_two_ranks_is_replicated_and_the_tokens_stay_the_same(mqa_dir, mqa_tp2):
    prompts = shared_prefix_prompts(256)
    one, two = serve(LLMEngine(mqa_dir, **TIGHT), prompts, 10), serve(mqa_tp2, prompts, 10)
    assert same_run(one, two) and two.preemptions > 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mqa_dir).eval()
    assert two.outputs == [evaluation.hf_greedy(hf, p, 10) for p in prompts]
    spec = mqa_tp2.config.spec
    assert qkv_partition(4, 1, 2).num_kv_head_replicas == 2
    assert rank_bytes_per_token(mqa_tp2) == [kv_bytes_per_token(spec, "fp32", 2)] * 2 == \
        [kv_bytes_per_token(spec, "fp32", 1)] * 2  # each rank holds the whole head: nothing saved


def test_a_rank_that_hangs_is_caught_by_the_collectives_timeout(mqa_tp2):
    pids = mqa_tp2.rank_executor.pids
    mqa_tp2.rank_executor.inject_fault(1, "hang")
    mqa_tp2.add_request([5, 6, 7, 8], max_tokens=2)
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed: it stopped answering"):
        mqa_tp2.step()
    assert time.monotonic() - started < 3 + 15  # the 3 s timeout, then the reports and the kill
    assert not any(alive(p) for p in pids)


# ----------------------------------------------------------------- the hybrid model, MLA, shutdown, torchrun


def test_the_hybrid_model_generates_the_same_tokens_on_two_ranks_and_shuts_down_clean(tiny_ministral_dir,
                                                                                       hf_ministral_greedy):
    prompts = shared_prefix_prompts(256, num_prompts=3, suffix_len=30)
    args = dict(TIGHT, num_gpu_blocks=20)
    one = serve(LLMEngine(tiny_ministral_dir, **args), prompts, 24)
    with LLMEngine(tiny_ministral_dir, tensor_parallel_size=2, **args) as engine:
        two = serve(engine, prompts, 24)
        pids = engine.rank_executor.pids
    assert same_run(one, two) and two.prefix_hit_tokens and two.partial_prefill_chunks and two.preemptions
    assert two.outputs == [hf_ministral_greedy(p, 24) for p in prompts]
    assert not any(alive(p) for p in pids) and not children() & set(pids)  # ps after: no rank left


def test_mla_replicates_the_latent_on_every_rank_and_generates_the_same_tokens(tiny_deepseek_dir):
    prompts = [random_token_ids(20, s, 256) for s in (1, 2)]
    one = LLMEngine(tiny_deepseek_dir, num_gpu_blocks=16, dtype="float32")
    with LLMEngine(tiny_deepseek_dir, num_gpu_blocks=16, dtype="float32", tensor_parallel_size=2) as two:
        assert two.generate(prompts, max_tokens=6) == one.generate(prompts, max_tokens=6)
        spec = two.config.spec
        assert rank_bytes_per_token(two) == [kv_bytes_per_token(spec, "fp32", 2)] * 2 == \
            [kv_bytes_per_token(spec, "fp32", 1)] * 2 == rank_bytes_per_token(one) * 2  # the whole latent, twice


def test_torchrun_runs_the_same_worker_entry_point(tiny_llama_dir):
    prompts = [random_token_ids(12, s) for s in (4, 5)]
    expected = LLMEngine(tiny_llama_dir, num_gpu_blocks=64, dtype="float32",
                         attention_backend="torch").generate(prompts, max_tokens=6)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(get_open_port()),
               "-m", "kvlab.engine.launch", str(tiny_llama_dir), "--max-tokens", "6",
               *[a for p in prompts for a in ("--prompt", ",".join(map(str, p)))]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected
    assert [r["rank"] for r in result["kv_cache_reports"]] == [0, 1]


# ----------------------------------------------------------------- refused shapes (no process started)


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "named"), [
    (4, 2, 3, r"num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
    (6, 3, 2, r"num_key_value_heads=3 \(num_kv_heads\) is not divisible by tensor_parallel_size=2"),
    (8, 2, 8, r"ok"),
    (12, 3, 4, r"num_key_value_heads=3 \(num_kv_heads\) with tensor_parallel_size=4"),
])
def test_a_split_vllm_refuses_is_refused_naming_both_numbers(heads, kv_heads, tp, named):
    if named == "ok":
        assert qkv_partition(heads, kv_heads, tp).num_kv_head_replicas == tp // kv_heads
        return
    with pytest.raises(KvlabValueError, match=named):
        qkv_partition(heads, kv_heads, tp)


def test_the_engine_refuses_a_tp_the_heads_cannot_split_before_starting_a_rank(tiny_llama_dir):
    before = children()
    with pytest.raises(KvlabValueError, match=r"num_attention_heads=4 .*tensor_parallel_size=3"):
        LLMEngine(tiny_llama_dir, tensor_parallel_size=3)
    with pytest.raises(KvlabValueError, match="cpu_offload_blocks"):
        LLMEngine(tiny_llama_dir, tensor_parallel_size=2, cpu_offload_blocks=4)
    assert children() == before
