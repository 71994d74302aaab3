"""Prefill and decode apart (notebook 11, part 2): two engines, a proxy, and the KV crossing between them.

One pair of engines per connector serves every test (building an engine costs seconds): a producer and a
consumer over ``P2pGlooConnector`` (gloo on 127.0.0.1), and over ``ExampleConnector`` (files in a temporary
folder); the same consumer also pulls from a producer on two ranks (tensor parallelism), each rank's KV head
landing at its place among the consumer's heads. The consumer's greedy tokens must equal a colocated engine's
and transformers'; the blocks must arrive bit for bit in every layer; an abort between the halves, a pull that
comes too late, and a shutdown must leave no block, thread or file behind.
"""

import threading
from pathlib import Path

import pytest
import torch

from kvlab.core.request import Request
from kvlab.data import TINY_MODEL_DIR
from kvlab.distributed.kv_transfer.kv_connector.utils import HeadSource, TransferTopology
from kvlab.engine import LLMEngine
from kvlab.engine.kv_cache_interface import layer_tensors
from kvlab.engine.kv_transfer_config import KVTransferConfig
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.fleet.disagg import DECODE, TRANSFER, DisaggProxy

ENGINE = {"num_gpu_blocks": 48, "block_size": 16, "max_num_batched_tokens": 128, "dtype": "float32"}  # fast on CPUs
A = random_token_ids(59, seed=3)                        # 3 full blocks and a partial one
B = A[:40] + random_token_ids(20, seed=4)               # shares A's first two full blocks
C = random_token_ids(9, seed=5)                         # less than a block


def p2p(role, **extra):
    return KVTransferConfig("P2pGlooConnector", kv_role=role, kv_port=0, kv_load_failure_policy="recompute",
                            kv_connector_extra_config=extra)


@pytest.fixture(scope="module")
def colocated():
    return LLMEngine(TINY_MODEL_DIR, **ENGINE)


@pytest.fixture(scope="module")
def hf_tiny_greedy():
    """transformers' greedy tokens on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    from kvlab.engine.evaluation import hf_greedy

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    return lambda prompt, n: hf_greedy(model, prompt, n)


@pytest.fixture(scope="module")
def reference(colocated):
    """The colocated engine's greedy tokens, each prompt alone."""
    return lambda prompt, n: colocated.generate([prompt], max_tokens=n)[0]


@pytest.fixture(scope="module")
def pair():
    producer = LLMEngine(TINY_MODEL_DIR, **ENGINE, kv_transfer_config=p2p("kv_producer", kv_timeout=5))
    consumer = LLMEngine(TINY_MODEL_DIR, **ENGINE, kv_transfer_config=p2p("kv_consumer", kv_timeout=5))
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    storage = {"shared_storage_path": str(tmp_path_factory.mktemp("kv-files"))}
    engines = [LLMEngine(TINY_MODEL_DIR, **ENGINE, kv_transfer_config=KVTransferConfig(
        "ExampleConnector", kv_role=role, kv_connector_extra_config=storage)) for role in ("kv_producer",
                                                                                           "kv_consumer")]
    return (*engines, storage["shared_storage_path"])


def assert_nothing_held(*engines):
    for engine in engines:
        assert engine.kv_cache_manager.usage == 0 and not engine.scheduler.requests and not engine.has_requests()


def slots(engine, block_ids, num_tokens):
    """Every layer's K and V at the first ``num_tokens`` slots of ``block_ids``: [num_tensors, num_tokens, ...]."""
    index = torch.tensor([block_ids[i // 16] * 16 + i % 16 for i in range(num_tokens)])
    return [t.view(-1, *t.shape[2:])[index] for kv in engine.kv_caches for t in layer_tensors(kv)]


def test_1p1d_over_gloo_gives_the_colocated_tokens_pulls_every_layer_bit_for_bit_and_frees_both_sides(pair, reference):
    producer, consumer = pair
    proxy = DisaggProxy(producer, consumer)
    (tokens,) = proxy.generate([A], max_tokens=8)
    assert tokens == reference(A, 8)  # and transformers': notebook 11 asserts both on the same checkpoint
    params = proxy.requests["pd-0"].kv_transfer_params
    assert params["remote_engine_id"] == producer.engine_config.kv_transfer_config.engine_id
    assert len(params["remote_block_ids"]) == 4 and params["remote_num_tokens"] == 59   # the partial block too
    worker = consumer.kv_connector_worker.connector_worker
    assert worker.num_blocks_received == 4 and worker.num_bytes_received == 4 * producer.bytes_per_block
    # The consumer's blocks hold the producer's KV, every layer, bit for bit (its own last token aside: it
    # computes that one itself). The freed blocks still hold it: nothing reused them yet.
    theirs = slots(producer, params["remote_block_ids"], 58)
    mine = slots(consumer, worker.pulled["pd-0"], 58)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(theirs, mine, strict=True))
    stats = consumer.history[0].connector_prefix_cache_stats
    assert (stats.queries, stats.hits) == (59, 59)                # vllm:external_prefix_cache_*
    assert_nothing_held(producer, consumer)


def cached_blocks(engine, prompt):
    """The blocks ``engine``'s prefix cache holds for ``prompt``'s full blocks (its last token aside)."""
    probe = Request("probe", prompt)
    hits, _, _ = engine.kv_cache_manager.get_computed_blocks(probe)
    return [b.block_id for b in hits.blocks[0]]


def test_a_prefix_the_consumer_holds_is_not_pulled_again(pair, reference):
    producer, consumer = pair
    proxy = DisaggProxy(producer, consumer)
    received = consumer.kv_connector_worker.connector_worker.num_blocks_received
    hits = consumer.kv_cache_manager.prefix_cache_stats.hits
    assert proxy.generate([B, C], max_tokens=6) == [reference(B, 6), reference(C, 6)]
    # B's first two blocks hit A's on the consumer: only its last two cross; C's one partial block crosses.
    assert consumer.kv_cache_manager.prefix_cache_stats.hits - hits == 32
    assert consumer.kv_connector_worker.connector_worker.num_blocks_received - received == 2 + 1
    assert_nothing_held(producer, consumer)


def test_an_abort_between_the_halves_releases_the_producers_blocks_and_leaves_nothing(pair):
    producer, consumer = pair
    proxy = DisaggProxy(producer, consumer)
    rid = proxy.add_request(random_token_ids(40, seed=9), max_tokens=4)
    while proxy.requests[rid].phase != TRANSFER:
        proxy.step()
    assert producer.kv_cache_manager.usage > 0                     # held for the pull that will not come
    proxy.abort(rid)                                              # the decode side tells the producer to let go
    proxy.run()
    assert proxy.requests[rid].finish_reason == "abort"
    assert_nothing_held(producer, consumer)


def test_an_abort_on_the_consumer_during_its_pull_waits_for_the_pull_then_frees(pair):
    producer, consumer = pair
    proxy = DisaggProxy(producer, consumer)
    rid = proxy.add_request(random_token_ids(50, seed=10), max_tokens=4)
    while proxy.requests[rid].phase != DECODE:
        proxy.step()
    proxy.step()                                                  # admitted: its blocks wait for the pull
    proxy.abort(rid)
    proxy.run()
    assert_nothing_held(producer, consumer)


def test_a_pull_after_the_lease_ran_out_fails_and_the_consumer_recomputes(pair, reference):
    producer, consumer = pair
    lease = producer.connector.connector_scheduler.kv_lease_duration
    producer.connector.connector_scheduler.kv_lease_duration = 0  # the producer gives up on every pull at once
    try:
        prompt = random_token_ids(45, seed=11)
        producer.add_request(prompt, max_tokens=1, request_id="late",
                             kv_transfer_params={"do_remote_decode": True})
        while producer.has_requests():                            # finishes, then frees at its next step
            producer.step()
        failures = consumer.scheduler.num_kv_load_failures
        computed = consumer.num_computed_tokens
        consumer.add_request(prompt, max_tokens=6, request_id="late",
                             kv_transfer_params=producer.kv_transfer_params["late"])
        while consumer.has_requests():
            consumer.step()
    finally:
        producer.connector.connector_scheduler.kv_lease_duration = lease
    assert consumer.scheduler.num_kv_load_failures == failures + 1
    assert consumer.outputs["late"] == reference(prompt, 6)       # recomputed: kv_load_failure_policy="recompute"
    assert consumer.num_computed_tokens - computed == 45 + 5      # the whole prompt, then the decode steps
    assert_nothing_held(producer, consumer)


def test_1p1d_through_files_gives_the_colocated_tokens_and_loads_every_layer_bit_for_bit(files, reference):
    producer, consumer, storage = files
    proxy = DisaggProxy(producer, consumer)
    assert proxy.generate([A, C], max_tokens=5) == [reference(A, 5), reference(C, 5)]
    writer, reader = producer.kv_connector_worker, consumer.kv_connector_worker
    num_layers = len(producer.kv_caches)
    # A's 58 tokens before its last: three whole blocks saved, one file per layer; C has no whole block.
    assert writer.num_files_written == reader.num_files_read == num_layers
    folder = writer._foldername(A[:48])
    assert sorted(p.name for p in Path(folder).iterdir()) == sorted(
        f"model.layers.{i}.self_attn.attn.safetensors" for i in range(num_layers))
    stats = consumer.history[0].connector_prefix_cache_stats
    assert (stats.queries, stats.hits) == (60 + 10, 48)
    theirs = slots(producer, cached_blocks(producer, A), 48)
    mine = slots(consumer, cached_blocks(consumer, A + [0]), 48)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(theirs, mine, strict=True))
    assert_nothing_held(producer, consumer)


def test_the_config_doors_refuse_what_kvlab_cannot_run():
    with pytest.raises(UnknownNameError, match="kv_connector"):
        KVTransferConfig("NixlConnector", kv_role="kv_both")
    with pytest.raises(KvlabValueError, match="kv_role"):
        KVTransferConfig("ExampleConnector")
    with pytest.raises(KvlabValueError, match="kv_load_failure_policy"):
        KVTransferConfig("ExampleConnector", kv_role="kv_both", kv_load_failure_policy="retry")
    with pytest.raises(KvlabValueError, match="cpu_offload_blocks"):
        LLMEngine(TINY_MODEL_DIR, **ENGINE, cpu_offload_blocks=4,
                  kv_transfer_config=KVTransferConfig("ExampleConnector", kv_role="kv_both"))


# ----------------------------------------------------------------- a producer on two ranks, a consumer on one


@pytest.mark.parametrize(("local_tp", "rank", "heads", "remote_tp", "mla", "expected"), [
    (1, 0, 2, 2, False, [HeadSource(0, 0, 0, 1), HeadSource(1, 1, 0, 1)]),    # one head from each producer rank
    (1, 0, 8, 4, False, [HeadSource(r, 2 * r, 0, 2) for r in range(4)]),     # two each, at their place
    (1, 0, 1, 2, False, [HeadSource(0, 0, 0, 1)]),                            # MQA: rank 1's copy is not read
    (2, 1, 8, 4, False, [HeadSource(2, 0, 0, 2), HeadSource(3, 2, 0, 2)]),   # a decode rank of two reads two ranks
    (4, 1, 8, 2, False, [HeadSource(0, 0, 2, 2)]),                            # decode TP > prefill TP: a slice
    (1, 0, 1, 4, True, [HeadSource(0, 0, 0, 0)]),                             # MLA: the whole latent, from rank 0
])
def test_each_local_head_is_read_from_the_first_remote_rank_that_holds_it(local_tp, rank, heads, remote_tp, mla,
                                                                          expected):
    assert TransferTopology(rank, local_tp, heads, mla).head_sources(remote_tp) == expected


@pytest.fixture(scope="module")
def tp2_producer():
    engine = LLMEngine(TINY_MODEL_DIR, **ENGINE, tensor_parallel_size=2,
                       kv_transfer_config=p2p("kv_producer", kv_timeout=5))
    yield engine
    engine.shutdown()


def test_a_producer_on_two_ranks_hands_each_ranks_kv_head_to_its_place_in_a_one_rank_consumer(
        tp2_producer, pair, reference, hf_tiny_greedy):
    producer, consumer = tp2_producer, pair[1]  # the consumer pulls from the one-rank producer too
    worker = consumer.kv_connector_worker.connector_worker
    received, moved = worker.num_blocks_received, worker.num_bytes_received
    proxy = DisaggProxy(producer, consumer)
    prompt = random_token_ids(59, seed=21)
    (tokens,) = proxy.generate([prompt], max_tokens=8)
    assert tokens == reference(prompt, 8) == hf_tiny_greedy(prompt, 8)
    rid = next(iter(proxy.requests))
    params = proxy.requests[rid].kv_transfer_params
    assert params["tp_size"] == 2 and len(params["remote_block_ids"]) == 4
    # Each rank sent its one KV head of the four blocks: half a block's bytes each, whole blocks in all.
    assert (worker.num_blocks_received - received, worker.num_bytes_received - moved) == \
        (4, 4 * consumer.bytes_per_block)
    # Bit for bit: head r of every layer's K and V, in the consumer's blocks, is rank r's (the freed producer blocks
    # still hold it: nothing reused them yet).
    ranks = producer.rank_executor.collective_rpc("kv_blocks", params["remote_block_ids"])
    mine = [t[worker.pulled[rid]] for kv in consumer.kv_caches for t in layer_tensors(kv)]
    assert len(ranks) == 2 and all(len(r) == len(mine) for r in ranks)
    for r, theirs in enumerate(ranks):
        for a, b in zip(theirs, mine, strict=True):  # [4, block_size, 1, head_size] against [4, block_size, 2, ...]
            assert torch.equal(a[:, :, 0].reshape(-1)[:58 * 64].view(torch.uint8),
                               b[:, :, r].reshape(-1)[:58 * 64].view(torch.uint8))
    assert_nothing_held(producer, consumer)  # both ranks reported the send before the blocks were freed


def test_an_abort_between_the_halves_releases_the_blocks_on_every_producer_rank(tp2_producer, pair):
    producer, consumer = tp2_producer, pair[1]
    proxy = DisaggProxy(producer, consumer)
    rid = proxy.add_request(random_token_ids(40, seed=22), max_tokens=4)
    while proxy.requests[rid].phase != TRANSFER:
        proxy.step()
    assert producer.kv_cache_manager.usage > 0
    proxy.abort(rid)
    proxy.run()
    assert_nothing_held(producer, consumer)


def test_the_doors_say_which_connector_runs_on_several_ranks(tmp_path):
    with pytest.raises(KvlabValueError, match="ExampleConnector.*tensor_parallel_size=2"):
        LLMEngine(TINY_MODEL_DIR, **ENGINE, tensor_parallel_size=2, kv_transfer_config=KVTransferConfig(
            "ExampleConnector", kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": str(tmp_path)}))
    with pytest.raises(KvlabValueError, match="kv_role='kv_consumer' with tensor_parallel_size=2"):
        LLMEngine(TINY_MODEL_DIR, **ENGINE, tensor_parallel_size=2, kv_transfer_config=p2p("kv_consumer"))


def test_shutdown_stops_every_thread_the_connectors_started(pair, tp2_producer):
    names = {t.name for t in threading.enumerate()}
    started = {"p2p-gloo-side-channel", "p2p-gloo-pull", "p2p-gloo-handshake"}
    assert started <= names
    pids = tp2_producer.rank_executor.pids
    for engine in (*pair, tp2_producer):
        engine.shutdown()
    assert not {t.name for t in threading.enumerate()} & started
    assert [p.exitcode for p in tp2_producer.rank_executor.procs] == [0, 0] and pids  # each rank left cleanly
