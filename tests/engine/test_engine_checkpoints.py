"""A checkpoint that is broken or disagrees with itself is refused by name: the file, and the field or tensor.

Every bad checkpoint here is made from the real tiny one (``save_tiny_llama``) with ``json`` and
``safetensors``, the way a hand-edited or half-downloaded folder would be broken.
"""

import json
import math
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlab.engine import LLMEngine, load_model
from kvlab.engine.config import DecoderConfig
from kvlab.errors import CheckpointError, KvlabValueError


@pytest.fixture
def checkpoint(tiny_llama_dir, tmp_path):
    """A private copy of the tiny checkpoint, to break."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, folder)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def edit_weights(folder, edit):
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors")


# ----------------------------------------------------------------- config.json against the tensors


@pytest.mark.parametrize("changes, words", [
    ({"num_hidden_layers": 1}, r"num_hidden_layers is 1, but the tensors hold layers 0\.\.1 \(2 layers\)"),
    ({"num_hidden_layers": 3}, r"num_hidden_layers is 3, but the tensors hold layers 0\.\.1"),
    ({"num_key_value_heads": 4}, r"model\.safetensors: model\.layers\.0\.self_attn\.k_proj\.weight has shape "
                                 r"\(32, 64\), but .*config\.json implies \(64, 64\) "
                                 r"\(num_key_value_heads x head_dim = 4 x 16, hidden_size = 64\)"),
    ({"intermediate_size": 256}, r"gate_proj\.weight has shape \(128, 64\).*intermediate_size = 256"),
    ({"head_dim": 8}, r"q_proj\.weight has shape \(64, 64\).*num_attention_heads x head_dim = 4 x 8"),
    ({"vocab_size": 300}, r"embed_tokens\.weight has shape \(256, 64\).*vocab_size = 300"),
])
def test_a_config_that_disagrees_with_the_tensors_is_refused_naming_the_field(checkpoint, changes, words):
    edit_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match=words):
        load_model(checkpoint)


def test_tensors_nothing_uses_missing_tensors_and_integer_weights_are_refused(checkpoint):
    edit_weights(checkpoint, lambda w: w.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) that nothing .* would use.*extra_proj"):
        load_model(checkpoint)
    edit_weights(checkpoint, lambda w: (w.pop("model.layers.0.mlp.extra_proj.weight"),
                                        w.pop("model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(checkpoint)
    edit_weights(checkpoint, lambda w: w.update({
        "model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.1\.mlp\.up_proj\.weight is "
                                              r"torch\.int32; weights must be floating point"):
        load_model(checkpoint)


def test_a_tied_checkpoint_that_also_ships_lm_head_loads_as_vllm_loads_it(checkpoint):
    edit_weights(checkpoint, lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"].clone()}))
    model = load_model(checkpoint)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # skipped: the embedding is the head


# ----------------------------------------------------------------- the files themselves


@pytest.mark.parametrize("text, words", [
    ("{not json", r"config\.json is not a readable JSON file: Expecting property name"),
    ("[1, 2]", r"config\.json: a config must be a JSON object \(a dict of fields\), got a list"),
])
def test_a_config_json_that_is_not_a_json_object_is_refused(checkpoint, text, words):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=words):
        load_model(checkpoint)


@pytest.mark.parametrize("changes, words", [
    ({"hidden_size": "64"}, r"config\.json field 'hidden_size' must be a positive integer .*, got '64'"),
    ({"num_attention_heads": "4"}, r"field 'num_attention_heads' must be a positive integer .*, got '4'"),
    ({"rms_norm_eps": "1e-6"}, r"field 'rms_norm_eps' must be a finite number > 0 .*, got '1e-6'"),
    ({"rms_norm_eps": -1.0}, r"field 'rms_norm_eps' must be a finite number > 0 .*, got -1\.0"),
    ({"rms_norm_eps": 0.0}, r"field 'rms_norm_eps' must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
     r"field 'rope_parameters\.rope_theta' must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta' must be a finite number"),
    ({"rope_parameters": None, "rope_theta": 0}, "field 'rope_theta' must be a finite number > 0"),  # older spelling
    ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' must be true or false"),
    ({"eos_token_id": "2"}, "field 'eos_token_id' must be a token id"),
    ({"max_position_embeddings": 0}, "field 'max_position_embeddings' must be a positive integer"),
])
def test_bad_values_in_config_json_are_refused_naming_the_file_and_the_field(checkpoint, changes, words):
    edit_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match=words) as refused:
        load_model(checkpoint)
    assert str(checkpoint / "config.json") in str(refused.value)


def test_llama3_rope_factors_that_would_divide_by_zero_are_refused():
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 1, "num_key_value_heads": 1}
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}
    with pytest.raises(KvlabValueError, match="high_freq_factor > low_freq_factor"):
        DecoderConfig.from_dict({**base, "rope_parameters": rope})


@pytest.mark.parametrize("cut, words", [
    (lambda data: data[: len(data) // 2], "incomplete metadata, file not fully covered"),
    (lambda data: b"not a safetensors file at all", "Error while deserializing header"),
])
def test_a_truncated_or_garbage_weight_file_is_refused_with_the_librarys_message(checkpoint, cut, words):
    path = checkpoint / "model.safetensors"
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors is not a readable safetensors file: .*{words}"):
        load_model(checkpoint)


def write_index(folder, weight_map):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                   "C:\\weights.safetensors"])
def test_shard_paths_that_leave_the_checkpoint_folder_are_refused(checkpoint, shard):
    names = load_file(checkpoint / "model.safetensors")
    write_index(checkpoint, {**dict.fromkeys(names, "model.safetensors"), "model.norm.weight": shard})
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        load_model(checkpoint)


def test_an_index_must_agree_with_its_shards(checkpoint):
    weights = load_file(checkpoint / "model.safetensors")
    names = dict.fromkeys(weights, "model.safetensors")
    write_index(checkpoint, {**names, "model.layers.9.mlp.up_proj.weight": "model.safetensors"})
    with pytest.raises(CheckpointError, match=r"lacks tensors that model\.safetensors\.index\.json puts there"):
        load_model(checkpoint)
    write_index(checkpoint, {**names, "model.norm.weight": "model-00002.safetensors"})
    with pytest.raises(CheckpointError, match=r"lists shards that are missing: \['model-00002\.safetensors'\]"):
        load_model(checkpoint)
    (checkpoint / "model.safetensors.index.json").write_text('{"weight_map": ["model.safetensors"]}')
    with pytest.raises(CheckpointError, match="'weight_map' object"):
        load_model(checkpoint)


def test_one_tensor_in_two_weight_files_is_refused(checkpoint):
    save_file({"model.norm.weight": torch.ones(64)}, checkpoint / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is in two weight files"):
        load_model(checkpoint)


def test_the_engine_refuses_a_broken_checkpoint_before_loading_anything(checkpoint):
    edit_config(checkpoint, rope_parameters={"rope_type": "default", "rope_theta": -1.0})
    with pytest.raises(CheckpointError, match="rope_theta"):
        LLMEngine(checkpoint, num_gpu_blocks=8)


def test_null_fields_take_their_defaults_as_transformers_reads_them(checkpoint):
    edit_config(checkpoint, rms_norm_eps=None, max_position_embeddings=None)
    config = load_model(checkpoint).config
    assert (config.rms_norm_eps, config.max_position_embeddings, config.tie_word_embeddings) == (1e-6, None, True)


# ----------------------------------------------------------------- checked before anything is built (issue 28)


@pytest.mark.parametrize("changes, words", [
    ({"num_hidden_layers": 9_000}, r"num_hidden_layers is 9000, but the tensors hold layers 0\.\.1"),  # main: ~16 s
    ({"vocab_size": 10**9}, r"embed_tokens\.weight has shape \(256, 64\).*vocab_size = 1000000000"),  # an OOM
])
def test_sizes_in_config_json_are_checked_against_the_headers_before_any_memory_is_allocated(checkpoint, changes,
                                                                                            words):
    edit_config(checkpoint, **changes)
    started = time.process_time()
    with pytest.raises(CheckpointError, match=words):
        load_model(checkpoint)
    assert time.process_time() - started < 5  # main built every layer, or allocated the embedding, first


def test_the_headers_are_read_without_the_weights(checkpoint):
    from kvlab.engine.loader import read_weights

    header, sources = read_weights(checkpoint, meta=True)
    weights, _ = read_weights(checkpoint)
    assert {n: (t.shape, t.dtype) for n, t in header.items()} == {n: (t.shape, t.dtype) for n, t in weights.items()}
    assert {t.device.type for t in header.values()} == {"meta"} and set(sources.values()) == {
        checkpoint / "model.safetensors"}


def test_a_weight_file_that_links_out_of_the_folder_is_refused_like_a_shard_path_that_does(checkpoint, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(checkpoint / "model.safetensors", outside)
    (checkpoint / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a link to .*elsewhere\.safetensors, which "
                                              r"leaves the checkpoint folder"):
        load_model(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "shard-1.safetensors").symlink_to(outside)  # the same rule for a shard the index lists
    write_index(checkpoint, dict.fromkeys(load_file(outside), "shard-1.safetensors"))
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        load_model(checkpoint)
    shutil.move(outside, checkpoint / "real.safetensors")  # a link that stays inside the folder is fine
    (checkpoint / "shard-1.safetensors").unlink()
    (checkpoint / "shard-1.safetensors").symlink_to(checkpoint / "real.safetensors")
    write_index(checkpoint, dict.fromkeys(load_file(checkpoint / "real.safetensors"), "shard-1.safetensors"))
    assert load_model(checkpoint).config.num_hidden_layers == 2


def test_a_tokenizer_that_asks_for_custom_code_is_refused_without_a_prompt(checkpoint, monkeypatch):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "a": 1}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
                            ).save_pretrained(checkpoint)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    ran = checkpoint / "custom-code-ran"
    (checkpoint / "tokenization_evil.py").write_text(f"open({str(ran)!r}, 'w')\nclass EvilTokenizer: pass\n")
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("the engine asked a question on stdin"))
    eng = LLMEngine(checkpoint, num_gpu_blocks=8)
    with pytest.raises(CheckpointError, match=r"could not be loaded without running code .*trust_remote_code=False"):
        eng.encode("a")
    assert not ran.exists()
