"""Each rank's shard, built and loaded in one process (no ranks started): which rows of q/k/v and which columns of
o_proj rank r of tp holds, KV heads replicated when fewer than the ranks, and the vocabulary split of the embedding."""

from __future__ import annotations

import pytest
import torch

from kvlab.distributed.parallel_state import GroupCoordinator
from kvlab.engine.config import DecoderConfig
from kvlab.engine.linear import ColumnParallelLinear, RowParallelLinear, load_weight
from kvlab.engine.model import LlamaAttention
from kvlab.engine.toy import TINY_LLAMA
from kvlab.engine.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size
from kvlab.errors import KvlabError


def config(heads: int, kv_heads: int) -> DecoderConfig:
    return DecoderConfig.from_dict({**TINY_LLAMA, "model_type": "llama", "num_attention_heads": heads,
                                    "num_key_value_heads": kv_heads, "hidden_size": 16 * heads})


def full_weights(cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    d, h = cfg.head_dim, cfg.hidden_size
    return {"q_proj": torch.randn(cfg.num_attention_heads * d, h, generator=gen),
            "k_proj": torch.randn(cfg.num_key_value_heads * d, h, generator=gen),
            "v_proj": torch.randn(cfg.num_key_value_heads * d, h, generator=gen),
            "o_proj": torch.randn(h, cfg.num_attention_heads * d, generator=gen)}


def rank_attention(cfg: DecoderConfig, rank: int, tp: int) -> LlamaAttention:
    layer = LlamaAttention(cfg, tp_group=GroupCoordinator.unconnected(rank, tp))
    for name, tensor in full_weights(cfg).items():
        load_weight(getattr(layer, name).weight, tensor)
    return layer


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(8, 2, 4), (8, 4, 2), (4, 1, 2), (8, 8, 8)])
def test_rank_r_holds_its_query_heads_and_the_kv_head_they_read(heads, kv_heads, tp):
    cfg = config(heads, kv_heads)
    full, d = full_weights(cfg), cfg.head_dim
    group = heads // kv_heads  # query heads per KV head (GQA)
    for r in range(tp):
        layer = rank_attention(cfg, r, tp)
        q_heads = list(range(r * heads // tp, (r + 1) * heads // tp))
        assert torch.equal(layer.q_proj.weight, full["q_proj"][q_heads[0] * d:(q_heads[-1] + 1) * d])
        kv = sorted({h // group for h in q_heads})  # the KV heads this rank's query heads attend with
        assert layer.num_kv_heads == len(kv) and layer.num_kv_head_replicas == max(1, tp // kv_heads)
        assert torch.equal(layer.k_proj.weight, full["k_proj"][kv[0] * d:(kv[-1] + 1) * d])
        assert torch.equal(layer.v_proj.weight, full["v_proj"][kv[0] * d:(kv[-1] + 1) * d])
        assert torch.equal(layer.o_proj.weight, full["o_proj"][:, q_heads[0] * d:(q_heads[-1] + 1) * d])


def test_the_ranks_partial_sums_of_a_row_parallel_layer_add_up_to_the_whole():
    gen = torch.Generator().manual_seed(1)
    weight, bias, x = torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen), torch.randn(3, 8, generator=gen)
    total = torch.zeros(3, 6)
    for r in range(2):
        layer = RowParallelLinear(8, 6, bias=True, tp_group=GroupCoordinator.unconnected(r, 2), reduce_results=False)
        load_weight(layer.weight, weight)
        layer.bias.data.copy_(bias)
        total += layer(x[:, r * 4:(r + 1) * 4])  # the column-parallel layer before gives rank r this slice
    torch.testing.assert_close(total, x @ weight.T + bias)  # the bias once: rank 0 adds it


def test_column_shards_concatenate_to_the_whole_and_the_checkpoint_shape_is_the_full_one():
    weight = torch.arange(24.0).view(6, 4)
    shards = []
    for r in range(3):
        layer = ColumnParallelLinear(4, 6, tp_group=GroupCoordinator.unconnected(r, 3))
        assert layer.weight.checkpoint_shape == (6, 4) and layer.weight.shape == (2, 4)
        load_weight(layer.weight, weight)
        shards.append(layer.weight.detach())
    assert torch.equal(torch.cat(shards), weight)


def test_the_vocabulary_is_padded_to_64_and_split_each_token_on_one_rank():
    table = torch.randn(100, 4)
    assert pad_vocab_size(100) == 128
    ranks = [VocabParallelEmbedding(100, 4, GroupCoordinator.unconnected(r, 2)) for r in range(2)]
    for layer in ranks:
        load_weight(layer.weight, table)
    assert (ranks[0].vocab_start_index, ranks[0].vocab_end_index) == (0, 64)
    assert (ranks[1].vocab_start_index, ranks[1].vocab_end_index) == (64, 100)
    assert torch.equal(ranks[1].weight[:36], table[64:]) and not ranks[1].weight[36:].any()  # the padding rows


def test_an_unconnected_group_refuses_a_collective_by_saying_what_to_do():
    with pytest.raises(KvlabError, match="init_distributed_environment"):
        GroupCoordinator.unconnected(0, 2).all_reduce(torch.ones(2))
    assert torch.equal(GroupCoordinator.unconnected(0, 1).all_reduce(torch.ones(2)), torch.ones(2))


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 2), (2, 4), (1, 2), (4, 2)])
def test_one_ranks_kv_tensors_hold_the_formulas_bytes_per_token(tmp_path, kv_heads, tp):
    """What each rank allocates (``allocate_kv_caches`` with the engine's tensor_parallel_size), measured from the
    tensors: 2 x L x max(1, Hkv / tp) x D x b per token, kvlab.capacity's per-rank formula."""
    import json

    from kvlab.capacity.sizing import kv_bytes_per_token
    from kvlab.engine.engine_config import EngineConfig
    from kvlab.engine.kv_pool import allocate_kv_caches, kv_cache_bytes

    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "model_type": "llama",
                                                      "num_key_value_heads": kv_heads}))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # the dtype probe reads a header
    config = EngineConfig(tmp_path, tensor_parallel_size=tp, num_gpu_blocks=8, dtype="float32", device="cpu",
                          attention_backend="torch")
    caches = allocate_kv_caches(config, 8, torch.float32)
    per_token = kv_cache_bytes(caches) / (8 * config.block_size)
    assert per_token == kv_bytes_per_token(config.model_config.spec, "fp32", tp)
    assert caches[0][0].shape[2] == max(1, kv_heads // tp)
