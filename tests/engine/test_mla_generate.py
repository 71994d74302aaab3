"""The tiny DeepSeek model generates through the paged latent cache exactly what transformers' generate does.

A minimal serving loop drives it (the engine integration comes later): a ``KVCacheManager`` hands
out blocks and finds prefix hits, ``kvlab.core.sequence.compute_slot_mapping`` turns block tables
into slots, every step is one flat batch. Prompts prefill by decompressing the latents, decode
steps go through the absorbed Triton kernel, several sequences per launch, and a prompt that shares
a prefix with an earlier one computes only its new tokens, reading the shared latents from blocks
the other request wrote.
"""

import kvlab.kernels
import torch
from kvlab.kernels import default_device

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.core.sequence import compute_slot_mapping
from kvlab.engine import AttentionMetadata
from kvlab.engine.deepseek import load_deepseek
from kvlab.engine.evaluation import hf_greedy
from kvlab.engine.mla import allocate_mla_kv_caches
from kvlab.engine.toy import random_token_ids

BLOCK_SIZE = 16


def flat_batch(manager, batch, device):
    """``input_ids``, ``positions`` and the metadata of one step: ``batch`` is ``[(request, token_ids)]``."""
    ids, positions, slots, seq_lens, starts, rows = [], [], [], [], [0], []
    for request, tokens in batch:
        first = request.num_computed_tokens
        block_ids = manager.get_block_ids(request.request_id)
        ids += tokens
        positions += range(first, first + len(tokens))
        slots += compute_slot_mapping(block_ids, BLOCK_SIZE, range(first, first + len(tokens)))
        seq_lens.append(first + len(tokens))
        starts.append(starts[-1] + len(tokens))
        rows.append(block_ids)
    width = max(len(r) for r in rows)
    table = [r + [0] * (width - len(r)) for r in rows]                        # padded with the null block

    def tensor(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(tensor(slots, torch.int64), tensor(table), tensor(seq_lens), tensor(starts))
    return tensor(ids, torch.int64), tensor(positions, torch.int64), meta


def serve(model, prompts, max_tokens, admit, num_blocks=32):
    """Greedy-generate ``max_tokens`` for each prompt; ``admit[step]`` names the prompts that arrive then.

    Returns the tokens of each prompt and the prefix-cache hits (tokens) each one was admitted with.
    """
    device = default_device()
    model.to(device)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, hash_seed="kvlab")
    caches = allocate_mla_kv_caches(model.config.mla, model.config.num_hidden_layers, num_blocks, BLOCK_SIZE,
                                    device=device)
    eos = set(model.config.eos_token_id)
    requests = {name: Request(name, prompt) for name, prompt in prompts.items()}
    running, hits, step = [], {}, 0
    while running or any(s >= step for s in admit):
        batch = []
        for request in running:                                              # decode: the last sampled token
            assert manager.allocate_slots(request, 1) is not None
            batch.append((request, [request.all_token_ids[-1]]))
        for name in admit.get(step, []):                                     # prefill what the cache lacks
            request = requests[name]
            blocks, hits[name], _ = manager.get_computed_blocks(request)
            assert manager.allocate_slots(request, request.num_tokens - hits[name], hits[name], blocks) is not None
            request.num_computed_tokens = hits[name]
            batch.append((request, list(request.all_token_ids[hits[name]:])))
            running.append(request)
        step += 1
        if not batch:
            continue
        input_ids, positions, meta = flat_batch(manager, batch, device)
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, caches, meta)[meta.logits_indices])
        for (request, tokens), row in zip(batch, logits.cpu(), strict=True):
            request.num_computed_tokens += len(tokens)
            token = int(row.argmax())
            request.append_output_token_ids(token)
            if token in eos or request.num_output_tokens == max_tokens:
                running.remove(request)
                manager.free(request)
    return {name: list(r.output_token_ids) for name, r in requests.items()}, hits


def test_greedy_tokens_equal_transformers_with_a_prefix_hit_and_batched_decodes(tiny_deepseek_dir, hf_deepseek,
                                                                                monkeypatch):
    launches = []
    real = kvlab.kernels.mla_decode

    def counting(q_latent, *args, **kwargs):                                  # how many sequences each launch serves
        launches.append(q_latent.shape[0])
        return real(q_latent, *args, **kwargs)

    monkeypatch.setattr(kvlab.kernels, "mla_decode", counting)
    long = random_token_ids(70, seed=11)              # 70 + 8 tokens: three tiles of 32 latents, five blocks
    prompts = {
        "long": long,
        "short": random_token_ids(5, seed=12),
        "shares 48": long[:48] + random_token_ids(12, seed=13),               # three full blocks in common
    }
    ours, hits = serve(load_deepseek(tiny_deepseek_dir), prompts, max_tokens=8,
                       admit={0: ["long", "short"], 1: ["shares 48"]})
    for name, prompt in prompts.items():
        assert ours[name] == hf_greedy(hf_deepseek, prompt, 8), name
    assert hits == {"long": 0, "short": 0, "shares 48": 48}                   # it computed 12 of its 60 tokens
    assert max(launches) == 3 and min(launches) >= 1                          # decodes share a kernel launch


def test_the_greedy_tokens_depend_on_the_first_prompt_token(hf_deepseek):
    # the sharpened attention reaches back: a cache that lost or misplaced early latents would change tokens
    prompt = random_token_ids(70, seed=11)
    changed = [prompt[0] % 200 + 7] + prompt[1:]
    assert hf_greedy(hf_deepseek, prompt, 8) != hf_greedy(hf_deepseek, changed, 8)
