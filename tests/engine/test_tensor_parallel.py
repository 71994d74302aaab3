"""Tensor parallelism across processes: the same tokens at TP=2 as at TP=1 and in transformers, each rank's KV
bytes as kvlab.capacity counts them, the collectives a step makes, refused shapes, a failing rank, a clean exit.

Each engine here starts two rank processes (a second, forked from the fork server); one engine per model serves
every check on it, in file order, and the last check on an engine stops it (a shutdown, a fault). The trained
model of data/ is notebook 11's, which runs the same checks on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.capacity.tp_cost import tp_step_collectives
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

#: Small enough to preempt, chunk and hit: 4 prompts sharing 32 tokens, a budget of 32 tokens, 14 blocks.
TIGHT = dict(num_gpu_blocks=14, max_num_batched_tokens=32, block_size=16, dtype="float32", attention_backend="torch")
HYBRID = dict(TIGHT, num_gpu_blocks=20)  # the hybrid frees blocks as its windows slide: 20 blocks, 24 tokens preempt


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


# ----------------------------------------------------------------- Hkv = 1 < tp: the KV head replicated


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-mqa"), num_key_value_heads=1)


@pytest.fixture(scope="module")
def mqa_tp2(mqa_dir):
    engine = LLMEngine(mqa_dir, tensor_parallel_size=2, **TIGHT)
    yield engine
    engine.shutdown()


def test_one_kv_head_on_two_ranks_gives_the_same_tokens_as_one_rank_and_transformers(mqa_dir, mqa_tp2):
    prompts = shared_prefix_prompts(256)
    one, two = serve(LLMEngine(mqa_dir, **TIGHT), prompts, 10), serve(mqa_tp2, prompts, 10)
    assert same_run(one, two)
    # all three paths; a preempted request prefills again, generated tokens included: nano-vllm's issue 144
    assert two.prefix_hit_tokens > 0 and two.partial_prefill_chunks > 0 and two.preemptions > 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mqa_dir).eval()
    assert two.outputs == [evaluation.hf_greedy(hf, p, 10) for p in prompts]


def test_each_rank_keeps_a_whole_copy_of_the_one_kv_head_as_the_formula_says(mqa_tp2):
    spec = mqa_tp2.config.spec
    assert qkv_partition(4, 1, 2).num_kv_head_replicas == 2
    assert rank_bytes_per_token(mqa_tp2) == [formula_bytes_per_token(mqa_tp2)] * 2 == \
        [kv_bytes_per_token(spec, "fp32", 2)] * 2 == [kv_bytes_per_token(spec, "fp32", 1)] * 2  # nothing saved
    assert {r["num_blocks"] for r in mqa_tp2.kv_cache_reports} == {mqa_tp2.num_gpu_blocks}  # one block count


def test_a_decode_step_makes_two_all_reduces_per_layer_plus_the_embedding_and_one_logits_gather(mqa_tp2):
    ids = [mqa_tp2.add_request(random_token_ids(5, s), max_tokens=3) for s in (1, 2)]
    mqa_tp2.step()  # the prefill
    _, stats = step_collectives(mqa_tp2)  # a decode step of 2 sequences
    expected = tp_step_collectives(mqa_tp2.config.spec, 2, num_seqs=2, activation_dtype="fp32")
    for rank in stats:
        assert (rank.all_reduce_calls, rank.all_gather_calls) == (expected.all_reduces, expected.all_gathers) == (5, 1)
        assert rank.all_reduce_bytes + rank.all_gather_bytes == expected.payload_bytes
    while mqa_tp2.has_unfinished_requests():
        mqa_tp2.step()
    assert all(mqa_tp2.finish_reasons[i] for i in ids)


def test_a_clean_shutdown_leaves_no_rank_running(mqa_tp2):
    pids = mqa_tp2.rank_executor.pids
    assert all(alive(p) for p in pids)
    mqa_tp2.shutdown()
    assert not any(alive(p) for p in pids) and [p.exitcode for p in mqa_tp2.rank_executor.procs] == [0, 0]
    out = subprocess.run(["ps", "-e", "-o", "pid="], capture_output=True, text=True).stdout  # ps after
    assert not {int(p) for p in out.split()} & set(pids)


# ----------------------------------------------------------------- Hkv = 2 = tp: the hybrid model, a rank that hangs


@pytest.fixture(scope="module")
def hybrid_tp2(tiny_ministral_dir):
    engine = LLMEngine(tiny_ministral_dir, tensor_parallel_size=2, distributed_timeout_seconds=3, **HYBRID)
    yield engine
    engine.shutdown()


def test_the_hybrid_model_generates_the_same_tokens_on_two_ranks_with_half_the_kv_each(
        tiny_ministral_dir, hybrid_tp2, hf_ministral_greedy):
    prompts = shared_prefix_prompts(256, num_prompts=3, suffix_len=30)
    one_engine = LLMEngine(tiny_ministral_dir, **HYBRID)
    one, two = serve(one_engine, prompts, 24), serve(hybrid_tp2, prompts, 24)
    assert same_run(one, two) and two.prefix_hit_tokens and two.partial_prefill_chunks and two.preemptions
    assert two.outputs == [hf_ministral_greedy(p, 24) for p in prompts]
    assert rank_bytes_per_token(hybrid_tp2) == [rank_bytes_per_token(one_engine)[0] / 2] * 2  # a KV head each


@pytest.mark.parametrize(("rank", "kind", "named"), [
    (2, "raise", r"rank=2: the ranks are 0 to 1"),
    (-1, "raise", r"rank must be a non-negative integer"),
    (True, "raise", r"rank must be a non-negative integer"),
    (1, "crash", r"kind"),
])
def test_a_fault_for_a_rank_or_of_a_kind_there_is_not_is_refused_by_name_and_arms_nothing(
        hybrid_tp2, rank, kind, named):
    with pytest.raises(KvlabValueError, match=named):
        hybrid_tp2.rank_executor.inject_fault(rank, kind)
    assert len(hybrid_tp2.generate([[5, 6, 7, 8]], max_tokens=2)[0]) == 2  # both ranks step as before


def test_a_rank_that_hangs_is_caught_by_the_collectives_timeout(hybrid_tp2):
    pids = hybrid_tp2.rank_executor.pids
    hybrid_tp2.rank_executor.inject_fault(1, "hang")
    hybrid_tp2.add_request([5, 6, 7, 8], max_tokens=2)
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed: it stopped answering"):
        hybrid_tp2.step()
    assert time.monotonic() - started < 3 + 15  # the 3 s timeout, then the reports and the kill
    assert not any(alive(p) for p in pids)


# ----------------------------------------------------------------- MLA, a rank that raises, torchrun


def test_mla_replicates_the_latent_on_every_rank_and_a_rank_that_raises_mid_step_stops_them_all(tiny_deepseek_dir):
    prompt = [random_token_ids(12, 1, 256)]
    one = LLMEngine(tiny_deepseek_dir, num_gpu_blocks=8, dtype="float32")
    with LLMEngine(tiny_deepseek_dir, num_gpu_blocks=8, dtype="float32", tensor_parallel_size=2) as two:
        assert two.generate(prompt, max_tokens=3) == one.generate(prompt, max_tokens=3)
        spec = two.config.spec
        assert rank_bytes_per_token(two) == [kv_bytes_per_token(spec, "fp32", 2)] * 2 == \
            [kv_bytes_per_token(spec, "fp32", 1)] * 2 == rank_bytes_per_token(one) * 2  # the whole latent, twice
        pids = two.rank_executor.pids
        two.rank_executor.inject_fault(1, "raise")
        two.add_request(prompt[0], max_tokens=2)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 failed: InjectedFault") as failure:
            two.step()
        assert failure.value.rank == 1 and "InjectedFault" in failure.value.tracebacks[1]
        assert time.monotonic() - started < 20 and not any(alive(p) for p in pids)
        with pytest.raises(RankFailedError):  # the engine is dead: the next step says so at once
            two.generate(prompt, max_tokens=1)
    assert not children() & set(pids)


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
