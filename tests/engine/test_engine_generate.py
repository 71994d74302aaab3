"""LLMEngine generates, token for token, what transformers' own generate produces on the same checkpoint.

Every scenario that moves KV around (batches, prefix hits, chunked prefill, preemption,
forks with copy-on-write) must leave the greedy tokens unchanged. The first tests prove the
comparison has teeth: the tiny model's tokens do depend on its context, so a cache that lost
or mixed up context would be caught. The engine runs its default attention backend (on a CPU the
torch path; ``test_engine_attention_backend`` shows the Triton kernels give the same tokens). Prompts are short.
"""

import dataclasses
import shutil

import pytest
import torch
from kvlab.kernels import TRITON_CUDA, backend, default_device

from kvlab.core.sched.output import SamplingParams, ScheduledRequest, SchedulerOutput
from kvlab.engine import LLMEngine, kv_pool, llm_engine, model_runner
from kvlab.engine.evaluation import relative_error
from kvlab.engine.input_batch import InputBatch
from kvlab.engine.model_runner import copy_blocks, prepare_inputs
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KernelInputError, KvlabValueError, RequestStateError, RequestTooLongError
from kvlab.units import cdiv


def engine(model_dir, **kwargs):
    return LLMEngine(model_dir, **{"num_gpu_blocks": 48, **kwargs})


# ----------------------------------------------------------------- the comparison can fail


def test_the_tiny_model_depends_on_an_early_prompt_token(hf_greedy):
    prompt = random_token_ids(24, seed=10)
    changed = list(prompt)
    changed[1] = (changed[1] + 1) % 256
    assert hf_greedy(prompt, 8) != hf_greedy(changed, 8)


def test_dropping_the_cached_context_changes_the_tokens(tiny_llama_dir, hf_greedy):
    prompt = random_token_ids(24, seed=11)
    eng = engine(tiny_llama_dir)
    eng.add_request(prompt, max_tokens=6, request_id="r")
    eng.step()  # the prefill wrote 24 tokens of K and V
    for key_cache, value_cache in eng.kv_caches:
        key_cache.zero_()
        value_cache.zero_()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.outputs["r"][0] == hf_greedy(prompt, 1)[0]  # sampled from the prefill's own logits
    assert eng.outputs["r"] != hf_greedy(prompt, 6)


# ----------------------------------------------------------------- token for token


def test_one_prompt_matches_transformers(tiny_llama_dir, hf_greedy):
    prompt = random_token_ids(24, seed=12)
    assert engine(tiny_llama_dir).generate([prompt], max_tokens=8) == [hf_greedy(prompt, 8)]


def test_a_batch_of_different_lengths_matches_transformers(tiny_llama_dir, hf_greedy):
    prompts = [random_token_ids(n, seed=20 + n) for n in (3, 16, 17, 30)]  # below, at and past a block boundary
    eng = engine(tiny_llama_dir)
    assert eng.generate(prompts, max_tokens=6) == [hf_greedy(p, 6) for p in prompts]
    assert max(h.num_running_reqs for h in eng.history) == 4  # they really ran together


def test_prefix_hits_give_the_same_tokens_and_are_counted(tiny_llama_dir, hf_greedy):
    system = random_token_ids(32, seed=30)  # two full blocks
    prompts = [system + random_token_ids(5, seed=31 + i) for i in range(3)]
    eng = engine(tiny_llama_dir)
    first = eng.generate(prompts[:1], max_tokens=4)
    rest = eng.generate(prompts[1:], max_tokens=4)
    assert first + rest == [hf_greedy(p, 4) for p in prompts]
    assert eng.metrics.prefix_cache_hits == 2 * 32
    assert eng.metrics.prefix_cache_queries == sum(len(p) for p in prompts)
    text = eng.metrics_text()
    assert "vllm:prefix_cache_hits_total{" in text and "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert f'{{engine="0",model_name="{tiny_llama_dir.name}"}} 64.0' in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_every_request_and_sample_is_timed_once_per_token(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    eng.generate([random_token_ids(n, seed=n) for n in (5, 20, 40)], max_tokens=4, ignore_eos=True)
    eng.add_request(random_token_ids(9, seed=9), max_tokens=3, n=2, temperature=1.0, seed=0, ignore_eos=True)
    while eng.has_unfinished_requests():
        eng.step()
    h = eng.latency.histograms
    assert h["vllm:time_to_first_token_seconds"].count == 3 + 2          # every request, each sample
    assert h["vllm:inter_token_latency_seconds"].count == 3 * 3 + 2 * 2   # every later token
    assert h["vllm:request_time_per_output_token_seconds"].count == 5     # one mean per finished request
    assert h["vllm:e2e_request_latency_seconds"].count == 5
    assert all(v > 0 for hist in h.values() for v in hist.values)         # seconds on this machine's clock
    assert "vllm:time_per_output_token_seconds" not in eng.metrics_text()  # 0.33.0 dropped it
    eng.add_request([5, 6, 7], request_id="x", n=2, temperature=1.0)     # its second sample will be "x#1"
    with pytest.raises(RequestStateError, match="already being timed"):   # refused before the scheduler sees it
        eng.add_request([5, 6, 7], request_id="x#1")
    assert eng.scheduler.get_num_unfinished_requests() == 1


def test_chunked_prefill_under_a_small_token_budget_matches(tiny_llama_dir, hf_greedy):
    prompts = [random_token_ids(20, seed=40), random_token_ids(13, seed=41)]
    eng = engine(tiny_llama_dir, max_num_batched_tokens=8)
    assert eng.generate(prompts, max_tokens=5) == [hf_greedy(p, 5) for p in prompts]
    assert all(h.num_scheduled_tokens <= 8 for h in eng.history)
    assert any(h.num_prefill_tokens and h.num_decode_tokens for h in eng.history)  # a mixed step


def test_preemption_in_a_tiny_pool_gives_the_same_tokens(tiny_llama_dir, hf_greedy):
    prompts = [random_token_ids(n, seed=50 + n) for n in (14, 10, 12)]
    eng = engine(tiny_llama_dir, num_gpu_blocks=5, block_size=8)  # 4 usable blocks: 32 slots for 3 requests
    assert eng.generate(prompts, max_tokens=8) == [hf_greedy(p, 8) for p in prompts]
    assert eng.metrics.num_preemptions > 0
    assert eng.kv_cache_manager.usage == 0


def test_parallel_samples_share_blocks_copy_on_write_and_match_independent_runs(tiny_llama_dir):
    prompt = random_token_ids(20, seed=60)  # block 8: two full blocks and a half-full third, shared by all
    forked = engine(tiny_llama_dir, block_size=8)
    samples = forked.generate([prompt], max_tokens=5, n=3, temperature=1.0, seed=7)[0]
    assert sum(h.num_block_copies for h in forked.history) == 2  # the last writer keeps the shared block
    alone = engine(tiny_llama_dir, block_size=8, enable_prefix_caching=False)
    ids = [alone.add_request(prompt, max_tokens=5, temperature=1.0, seed=7 + i) for i in range(3)]
    while alone.has_unfinished_requests():
        alone.step()
    assert samples == [alone.outputs[i] for i in ids]
    assert len({tuple(s) for s in samples}) > 1  # temperature 1 really samples


def test_without_the_physical_copies_the_forked_samples_go_wrong(tiny_llama_dir, monkeypatch):
    prompt = random_token_ids(20, seed=60)
    right = engine(tiny_llama_dir, block_size=8).generate([prompt], max_tokens=5, n=3, temperature=1.0, seed=7)[0]
    monkeypatch.setattr(model_runner, "copy_blocks", lambda kv_caches, blocks_to_copy: None)
    wrong = engine(tiny_llama_dir, block_size=8).generate([prompt], max_tokens=5, n=3, temperature=1.0, seed=7)[0]
    assert wrong[-1] == right[-1]  # the last writer kept the original block
    assert wrong[:-1] != right[:-1]  # the others read a copy that was never made


def test_a_request_that_can_never_fit_is_refused_and_the_others_are_served(tiny_llama_dir, hf_greedy):
    eng = engine(tiny_llama_dir, num_gpu_blocks=3, block_size=8)  # 2 usable blocks: 16 slots
    short = random_token_ids(6, seed=70)
    eng.add_request(short, max_tokens=3, request_id="short")
    with pytest.raises(RequestTooLongError, match="needs 3 blocks"):
        eng.add_request(random_token_ids(17, seed=71), max_tokens=1, request_id="long")
    with pytest.raises(RequestTooLongError):
        eng.generate([short, random_token_ids(30, seed=72)], max_tokens=2)  # checked before anything is queued
    assert eng.scheduler.get_num_unfinished_requests() == 1
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.outputs["short"] == hf_greedy(short, 3)


def test_fp8_kv_cache_stores_a_quarter_of_float32_and_rounds_the_logits_a_little(tiny_llama_dir):
    prompt = random_token_ids(24, seed=80)
    full = engine(tiny_llama_dir, keep_logits=True)
    fp8 = engine(tiny_llama_dir, kv_cache_dtype="fp8", keep_logits=True)
    assert fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.kv_cache_bytes * 4 == full.kv_cache_bytes
    fp8.generate([prompt], max_tokens=1)
    full.generate([prompt], max_tokens=1)
    error = relative_error(fp8.model_runner.logits["0"][0], full.model_runner.logits["0"][0])
    assert 0 < error < 0.15  # rounded (3 mantissa bits), not broken


def test_string_prompts_go_through_the_checkpoints_tokenizer(tiny_llama_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    characters = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    characters.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=characters, eos_token="</s>").save_pretrained(tmp_path)
    eng = engine(tmp_path)
    ids = eng.encode("paged kv")
    assert ids == [vocab[ch] for ch in "paged kv"]
    assert eng.generate(["paged kv"], max_tokens=2) == eng.generate([ids], max_tokens=2)


def test_bad_engine_arguments_are_refused_by_name(tiny_llama_dir):
    with pytest.raises(KvlabValueError, match="kv_cache_dtype"):
        LLMEngine(tiny_llama_dir, kv_cache_dtype="int4")
    with pytest.raises(KvlabValueError, match="not both"):
        LLMEngine(tiny_llama_dir, num_gpu_blocks=8, kv_cache_memory_gib=1.0)
    with pytest.raises(KvlabValueError, match="token ids"):
        engine(tiny_llama_dir).add_request([1, 2, 999])
    with pytest.raises(KvlabValueError, match="no tokenizer"):
        engine(tiny_llama_dir).add_request("hello")


def test_the_engine_runs_where_the_kernels_run(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    where = torch.device(default_device()).type  # "cuda" with native Triton, else "cpu"
    assert eng.device.type == where
    assert {p.device.type for p in eng.model.parameters()} == {where}
    assert {t.device.type for kv in eng.kv_caches for t in kv} == {where}


def test_a_device_the_kernels_cannot_use_is_refused_before_anything_loads(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    for bad in ("gpu", "meta"):
        with pytest.raises(KvlabValueError, match=f"device must be 'cpu' or 'cuda'.*{bad}"):
            LLMEngine(tiny_llama_dir, device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(KvlabValueError, match="torch sees none"):
            LLMEngine(tiny_llama_dir, device="cuda")
    if backend() == TRITON_CUDA:  # native kernels cannot read host memory
        with pytest.raises(KernelInputError, match="CUDA tensors"):
            LLMEngine(tiny_llama_dir, device="cpu")


def test_the_pool_is_sized_from_memory_as_vllm_sizes_it(tiny_llama_dir):
    eng = LLMEngine(tiny_llama_dir, kv_cache_memory_gib=1 / 1024, block_size=16)  # 1 MiB
    per_block = eng.plan.bytes_per_block
    assert per_block == 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads, head 16, fp32, 16 tokens
    assert eng.num_gpu_blocks == 2**20 // per_block
    assert eng.startup_log()[1].startswith(f"GPU KV cache size: {eng.num_gpu_blocks * 16:,} tokens, ")


def test_a_default_pool_holds_max_num_seqs_full_requests_within_a_memory_cap(tiny_llama_dir, monkeypatch):
    roomy = LLMEngine(tiny_llama_dir, max_num_seqs=4, block_size=16)
    assert roomy.num_gpu_blocks == 1 + 4 * cdiv(512, 16)  # the config's 512 positions
    monkeypatch.setattr(kv_pool, "DEFAULT_KV_CACHE_MEMORY_GIB", 1 / 1024)  # 1 MiB
    capped = LLMEngine(tiny_llama_dir, max_num_seqs=4, block_size=16)
    assert capped.num_gpu_blocks == 2**20 // capped.plan.bytes_per_block == 128


# ----------------------------------------------------------------- the executor's pure parts


def test_prepare_inputs_flattens_a_mixed_batch():
    params = SamplingParams()
    out = SchedulerOutput(step=0, scheduled=[
        ScheduledRequest("a", (5, 6, 7), 0, (3, 9), True, params),  # a prefill of 3 tokens
        ScheduledRequest("b", (8,), 17, (4, 1, 2), True, params),  # a decode at position 17
    ], scheduled_new_req_ids=["a"], scheduled_resumed_req_ids=[], scheduled_running_req_ids=["b"],
        preempted_req_ids=[], finished_req_ids=set(), blocks_to_copy=[])
    input_ids, positions, meta = prepare_inputs(out, block_size=8)
    assert input_ids.tolist() == [5, 6, 7, 8] and positions.tolist() == [0, 1, 2, 17]
    on_meta = prepare_inputs(out, block_size=8, device="meta")  # every tensor is built where the model runs,
    device = (on_meta[2].slot_mapping, on_meta[2].block_table, on_meta[2].seq_lens, on_meta[2].query_start_loc)
    assert {t.device.type for t in (*on_meta[:2], *device)} == {"meta"}
    host = on_meta[2].host  # but for the host copies the kernels' checks read (no device sync)
    assert {t.device.type for t in (*dataclasses.astuple(host), on_meta[2].slot_mapping_cpu)} == {"cpu"}
    assert host.block_table_cpu.tolist() == [[3, 9, 0], [4, 1, 2]]
    assert meta.slot_mapping.tolist() == [24, 25, 26, 2 * 8 + 1]  # position 17: block 2, offset 1
    assert meta.block_table.tolist() == [[3, 9, 0], [4, 1, 2]]  # padded with the null block
    assert meta.seq_lens.tolist() == [3, 18] and meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.logits_indices.tolist() == [2, 3]


def test_the_persistent_batch_writes_a_table_once_and_then_only_the_new_block_ids():
    params = SamplingParams()

    def decode(*entries):  # (request id, position, block ids sent, whole table?) -> one step of decodes
        scheduled = [ScheduledRequest(rid, (5,), pos, tuple(ids), True, params, whole_table=whole)
                     for rid, pos, ids, whole in entries]
        return SchedulerOutput(step=0, scheduled=scheduled, scheduled_new_req_ids=[], scheduled_resumed_req_ids=[],
                               scheduled_running_req_ids=[], preempted_req_ids=[], finished_req_ids=set(),
                               blocks_to_copy=[])

    batch = InputBatch(num_groups=1)
    batch.update(decode(("a", 9, (3, 9), True), ("b", 3, (4,), True)))      # first steps: whole tables
    batch.update(decode(("b", 4, (), False), ("a", 16, (5,), False)))        # a crosses into a third block
    step = batch.prepare(decode(("b", 7, (), False), ("a", 17, (), False)), block_size=8)
    assert step.block_tables[0].tolist() == [[4, 0, 0], [3, 9, 5]]          # in the step's order, padded with 0
    assert step.slot_mappings[0].tolist() == [4 * 8 + 7, 5 * 8 + 1]
    assert step.positions.tolist() == [7, 17] and step.seq_lens.tolist() == [8, 18]
    batch.update(SchedulerOutput(0, [], [], [], [], [], {"a"}, []))         # a finished: its row is free again
    batch.add_request("c", [list(range(1, 41))])                              # row 0 again, the table grows
    assert batch.req_id_to_index == {"b": 1, "c": 0} and batch.block_tables[0].block_table.shape[1] >= 40
    with pytest.raises(KvlabValueError, match="whole block table"):
        batch.update(decode(("stranger", 3, (6,), False)))


def test_copy_blocks_copies_every_layer_k_and_v():
    caches = [(torch.randn(4, 2, 1, 16), torch.randn(4, 2, 1, 16)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [(1, 3)])
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k[3], k0[1]) and torch.equal(v[3], v0[1]) and torch.equal(k[:3], k0[:3])
