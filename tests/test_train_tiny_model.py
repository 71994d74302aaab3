"""The tiny trained Llama: its recipe still runs and is deterministic, and the committed checkpoint serves text.

``scripts/train_tiny_model.py`` made ``data/tiny-pydoc-llama/``. Here a few steps of the same recipe
run again (seconds) and must replay the recorded losses, and the committed folder is loaded by
transformers and by kvlab, which must generate the same greedy tokens for the same text prompts.
"""

import hashlib
import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.data import TINY_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_tiny_model.py"
MODEL_DIR = TINY_MODEL_DIR                      # data/tiny-pydoc-llama
CHECKPOINT_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "recipe.json", "README.md")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="module")
def recipe_json():
    return json.loads((MODEL_DIR / "recipe.json").read_text(encoding="utf-8"))


def need_prose_revision(script):
    done = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{script.PROSE_REVISION}^{{commit}}"],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"this clone lacks commit {script.PROSE_REVISION[:12]} the recipe reads its prose at (shallow?)")


def test_three_steps_of_the_recipe_replay_the_committed_run_and_write_a_checkpoint_both_libraries_load(
        script, recipe_json, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from kvlab.engine import load_model

    need_prose_revision(script)
    # One thread (the recorded run used two) is quicker on a shared machine; sums round differently, hence 1e-3.
    summary = script.main(["--steps", "3", "--out", str(tmp_path), "--sample-tokens", "2", "--eval-windows", "1",
                           "--threads", "1"])
    for name in CHECKPOINT_FILES:
        assert (tmp_path / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert tokenizer.eos_token_id == hf.config.eos_token_id == 0
    assert summary["parameters"] == sum(p.numel() for p in hf.parameters()) == recipe_json["parameters"]
    assert sum(p.numel() for p in load_model(tmp_path).parameters()) == summary["parameters"]
    if platform.python_version() == recipe_json["corpus"]["python"]:
        # Same corpus, same tokenizer, the same first losses: the script still makes the committed model.
        assert summary["corpus"]["sha256"] == recipe_json["corpus"]["sha256"]
        committed = json.loads((MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
        assert json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))["model"] == committed["model"]
        assert summary["loss"]["per_step"] == pytest.approx(recipe_json["loss"]["per_step"][:3], abs=1e-3)


def test_the_committed_checkpoint_is_what_its_recipe_says(script, recipe_json):
    from transformers import AutoConfig

    config, recipe = AutoConfig.from_pretrained(MODEL_DIR), recipe_json["recipe"]
    assert (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (
        recipe["num_hidden_layers"], recipe["num_key_value_heads"], recipe["vocab_size"])
    assert 4 <= config.num_hidden_layers <= 6 and config.num_key_value_heads == 2
    assert config.max_position_embeddings == recipe["context"]
    for name, size in recipe_json["files"].items():
        assert (MODEL_DIR / name).stat().st_size == size, name
    assert recipe["prose_revision"] == script.PROSE_REVISION and recipe_json["corpus"]["prose_files"] == list(
        script.PROSE_FILES)
    assert recipe_json["model_sha256"] == hashlib.sha256((MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()


def test_the_chat_template_renders_exactly_the_training_format(script):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    messages = [{"role": "system", "content": script.SYSTEM_PROMPT}, {"role": "user", "content": "Explain pass."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered + "The pass page." + script.EOS == script.chat_text("Explain pass.", "The pass page.")
    answered = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": "A."}], tokenize=False)
    assert answered == script.chat_text("Explain pass.", "A.")


def test_kvlab_and_transformers_generate_the_same_greedy_text(script, recipe_json):
    from transformers import AutoModelForCausalLM

    from kvlab.engine import LLMEngine
    from kvlab.engine.evaluation import hf_greedy

    engine = LLMEngine(MODEL_DIR, num_gpu_blocks=24, max_model_len=recipe_json["recipe"]["context"])
    tokenizer = engine.tokenizer
    questions = ['What does the documentation say about the "for" statement?', "Explain the power operator."]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": script.SYSTEM_PROMPT},
                                              {"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    kvlab_tokens = engine.generate(prompts, max_tokens=10)
    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    hf_tokens = [hf_greedy(hf, engine.encode(p), 10) for p in prompts]
    assert kvlab_tokens == hf_tokens
    # a trained page is recalled: asked about the "for" statement, it starts with that page's title
    assert tokenizer.decode(kvlab_tokens[0]).startswith('The "for" statement')


def test_kvlab_names_the_checkpoint_and_the_system_prompt_it_was_trained_with(script):
    from kvlab.data import TINY_MODEL_SYSTEM_PROMPT, chat_prompt

    assert TINY_MODEL_DIR.resolve() == script.DEFAULT_OUT.resolve()
    assert TINY_MODEL_SYSTEM_PROMPT == script.SYSTEM_PROMPT
    assert script.chat_text("Q?", "A.").startswith(chat_prompt("Q?"))      # the prompt is the turn up to its answer
