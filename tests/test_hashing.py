"""Block hashes as vLLM V1 computes them: the four functions, the chain, its seed, extra keys, collisions."""

import hashlib
import os
import pickle
import subprocess
import sys

import cbor2
import pytest
import xxhash

from kvlab.core import hashing
from kvlab.core.hashing import (
    HASH_FUNCTIONS,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    none_hash_from_seed,
)
from kvlab.core.request import MultiModalFeatureSpec, PlaceholderRange, Request
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.sim.collisions import count_distinct_hashes, find_block_collision, truncated_hash
from kvlab.sim.hash_cost import measure_hash_cost


def test_the_four_functions_are_serialisation_then_digest():
    obj = (b"parent", (1, 2, 3), None)
    assert hashing.sha256(obj) == hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert hashing.sha256_cbor(obj) == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    assert hashing.xxhash(obj) == xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    assert hashing.xxhash_cbor(obj) == xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))
    assert {name: len(fn(obj)) for name, fn in HASH_FUNCTIONS.items()} == {
        "sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


def test_get_hash_fn_by_name_lists_the_known_names():
    assert get_hash_fn_by_name("sha256_cbor") is hashing.sha256_cbor
    with pytest.raises(UnknownNameError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        get_hash_fn_by_name("md5")


def test_hash_block_tokens_hashes_parent_tokens_and_extra_keys_together():
    parent = b"p" * 32
    assert hash_block_tokens(hashing.sha256, parent, [1, 2], ("lora",)) == hashing.sha256((parent, (1, 2), ("lora",)))
    assert hash_block_tokens(hashing.sha256, None, (1, 2)) == hashing.sha256((hashing.NONE_HASH, (1, 2), None))


def test_the_chain_makes_a_blocks_hash_depend_on_its_whole_prefix():
    fn, seed = hashing.sha256, b"s" * 32

    def chain(token_ids, block_size=4):
        out, parent = [], seed
        for i in range(0, len(token_ids) - block_size + 1, block_size):
            parent = hash_block_tokens(fn, parent, token_ids[i:i + block_size])
            out.append(parent)
        return out

    a = chain([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    changed_first = chain([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert all(x != y for x, y in zip(a, changed_first, strict=True))  # one token changes every later hash
    moved = chain([9, 9, 9, 9, 1, 2, 3, 4])
    assert moved[1] != a[0]  # the same four tokens one block later are another block


def test_none_hash_is_fixed_for_sha256_random_for_xxhash_unless_a_seed_is_set(monkeypatch):
    assert none_hash_from_seed(hashing.sha256, "123") == hashing.sha256("123")
    assert none_hash_from_seed(hashing.sha256, None) == hashing.sha256("vllm-none-hash")  # vLLM 0.33.0's default
    assert none_hash_from_seed(hashing.sha256_cbor, None) == hashing.sha256_cbor("vllm-none-hash")
    for weak in (hashing.xxhash, hashing.xxhash_cbor):  # not collision resistant: the seed must stay secret
        assert len(none_hash_from_seed(weak, None)) == 16
        assert none_hash_from_seed(weak, None) != none_hash_from_seed(weak, None)
    with pytest.raises(KvlabValueError, match="hash_seed"):
        none_hash_from_seed(hashing.sha256, 123)
    monkeypatch.setattr(hashing, "NONE_HASH", hashing.NONE_HASH)  # restored after the test
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert hashing.init_none_hash(hashing.xxhash) == hashing.xxhash("7") == hashing.NONE_HASH
    monkeypatch.setenv("PYTHONHASHSEED", "random")  # the literal string: it seeds the chain like any other
    assert hashing.init_none_hash(hashing.sha256) == hashing.sha256("random")


def test_separate_processes_agree_on_sha256_hashes_and_on_xxhash_only_with_the_same_pythonhashseed():
    def run(seed, fn):
        code = (f"from kvlab.core import hashing; h = hashing.init_none_hash(hashing.{fn}); "
                f"print(hashing.hash_block_tokens(hashing.{fn}, None, range(16)).hex())")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout

    assert run("0", "xxhash_cbor") == run("0", "xxhash_cbor") != run("1", "xxhash_cbor")
    assert run(None, "xxhash_cbor") != run(None, "xxhash_cbor")
    assert run(None, "sha256_cbor") == run(None, "sha256_cbor") != run("0", "sha256_cbor")


def _request(n, **kwargs):
    return Request("r", list(range(n)), **kwargs)


def test_extra_keys_lora_on_every_block_salt_on_the_first_only():
    assert generate_block_hash_extra_keys(_request(32), 0, 16) == (None, 0)
    r = _request(32, lora_name="sql", lora_path="/adapters/sql", cache_salt="tenant-a")
    assert generate_block_hash_extra_keys(r, 0, 16)[0] == (("lora", "sql", "/adapters/sql"),
                                                           ("cache_salt", "tenant-a"))
    assert generate_block_hash_extra_keys(r, 16, 32)[0] == (("lora", "sql", "/adapters/sql"),)
    assert generate_block_hash_extra_keys(_request(16, lora_name="x"), 0, 16)[0] == (("lora", "x", "x"),)
    with pytest.raises(KvlabValueError, match="end_token_idx"):
        generate_block_hash_extra_keys(r, 16, 16)


def test_each_kind_of_extra_key_is_tagged_so_no_value_of_one_kind_stands_for_another():
    same = list(range(16))
    lora, salt = Request("a", same, lora_name="x"), Request("b", same, cache_salt="x")
    assert generate_block_hash_extra_keys(lora, 0, 16)[0] != generate_block_hash_extra_keys(salt, 0, 16)[0]
    one, other = (Request(i, same, lora_name="x", lora_path=p) for i, p in (("c", "/a/x"), ("d", "/b/x")))
    assert generate_block_hash_extra_keys(one, 0, 16)[0] != generate_block_hash_extra_keys(other, 0, 16)[0]


def test_extra_keys_name_each_image_with_its_offset_inside_the_block():
    images = [MultiModalFeatureSpec("cat", PlaceholderRange(10, 12)),
              MultiModalFeatureSpec("dog", PlaceholderRange(22, 20))]
    r = _request(64, mm_features=images)
    assert generate_block_hash_extra_keys(r, 0, 16) == ((("mm", "cat", 10),), 0)  # the cat runs on into block 1
    assert generate_block_hash_extra_keys(r, 16, 32) == ((("mm", "cat", -6), ("mm", "dog", 6)), 1)
    assert generate_block_hash_extra_keys(r, 32, 48, 1) == ((("mm", "dog", -10),), 2)
    assert generate_block_hash_extra_keys(r, 48, 64, 2) == (None, 2)


def test_request_hasher_hashes_full_blocks_only_and_extends_as_tokens_arrive():
    hasher = get_request_block_hasher(16, hashing.sha256, none_hash=b"x" * 32)
    r = _request(40)
    r.block_hashes.extend(hasher(r))
    assert len(r.block_hashes) == 2
    assert r.block_hashes[0] == hash_block_tokens(hashing.sha256, b"x" * 32, range(16))
    assert r.block_hashes[1] == hash_block_tokens(hashing.sha256, r.block_hashes[0], range(16, 32))
    r.append_output_token_ids([1] * 7)  # 47 tokens: still two full blocks
    assert hasher(r) == []
    r.append_output_token_ids(2)
    assert hasher(r) == [hash_block_tokens(hashing.sha256, r.block_hashes[1], list(range(32, 40)) + [1] * 7 + [2])]


@pytest.mark.parametrize("kwargs, text", [
    ({"request_id": ""}, "request_id"),
    ({"prompt_token_ids": []}, "at least one token"),
    ({"prompt_token_ids": [1, -2]}, r"prompt_token_ids\[1\] must be an integer >= 0"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"mm_features": [MultiModalFeatureSpec("x", PlaceholderRange(2, 9))]}, "past the prompt"),
])
def test_bad_requests_are_refused(kwargs, text):
    args = {"request_id": "r", "prompt_token_ids": [1, 2, 3], **kwargs}
    with pytest.raises(KvlabValueError, match=text):
        Request(args.pop("request_id"), args.pop("prompt_token_ids"), **args)


def test_a_16_bit_hash_collides_within_a_few_hundred_blocks_and_the_real_ones_do_not():
    weak = truncated_hash("sha256", 16)
    collision = find_block_collision(weak, 16, b"seed", seed=0)
    assert collision.tokens_a != collision.tokens_b
    assert hash_block_tokens(weak, b"seed", collision.tokens_a) == hash_block_tokens(weak, b"seed", collision.tokens_b)
    assert len(collision.tried) < 2000
    distinct = len(set(collision.tried))
    assert count_distinct_hashes(weak, b"seed", collision.tried) < distinct
    for fn in HASH_FUNCTIONS.values():
        assert count_distinct_hashes(fn, b"seed", collision.tried) == distinct
    with pytest.raises(KvlabValueError, match="multiple of 8"):
        truncated_hash("sha256", 12)


def test_hash_cost_rows_exist_for_every_function_and_block_size():
    rows = measure_hash_cost(block_sizes=(16, 64), number=20, repeat=1)
    names = {r["hash_fn"] for r in rows}
    assert set(HASH_FUNCTIONS) <= names and {r["block_size"] for r in rows} == {16, 64}
    assert all(r["seconds_per_block"] > 0 for r in rows)
