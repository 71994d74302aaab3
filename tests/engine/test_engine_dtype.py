"""The engine's dtype follows vLLM 0.33.0's ``--dtype`` rule, and every comparison with transformers uses one dtype.

"auto" is the checkpoint's dtype (``config.json``'s ``dtype``, else its weights'), kept where the
device computes it; a float32 checkpoint stays float32 (vLLM would downcast it to bf16: kvlab's
stated difference) and Triton's interpreter computes in float32 only, said in a start-up line.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.data import TINY_MODEL_DIR
from kvlab.engine import LLMEngine
from kvlab.engine.dtype import checkpoint_dtype, resolve_dtype
from kvlab.engine.evaluation import hf_greedy
from kvlab.errors import KvlabValueError

CPU = torch.device("cpu")


def test_auto_is_the_checkpoints_dtype_where_the_device_computes_it():
    assert resolve_dtype("auto", torch.bfloat16, CPU, interpreter=False) == (torch.bfloat16, None)
    assert resolve_dtype("auto", torch.float32, CPU, interpreter=False) == (torch.float32, None)  # vLLM: bf16
    assert resolve_dtype("auto", torch.bfloat16, CPU, interpreter=True) == (
        torch.float32, "Upcasting torch.bfloat16 to torch.float32. (dtype='auto' under Triton's interpreter, which "
        "computes in float32 only)")


def test_explicit_dtypes_are_taken_as_given_and_a_cast_is_logged_as_vllm_logs_it():
    assert resolve_dtype("float32", torch.bfloat16, CPU, False) == (torch.float32,
                                                                     "Upcasting torch.bfloat16 to torch.float32.")
    assert resolve_dtype("bfloat16", torch.float32, CPU, False) == (torch.bfloat16,
                                                                     "Downcasting torch.float32 to torch.bfloat16.")
    assert resolve_dtype("half", torch.bfloat16, CPU, False) == (torch.float16,
                                                                  "Casting torch.bfloat16 to torch.float16.")
    assert resolve_dtype(torch.bfloat16, torch.bfloat16, CPU, False) == (torch.bfloat16, None)


@pytest.mark.parametrize("dtype", ["float64", "int8", 16, None, torch.float64])
def test_an_unknown_dtype_is_refused_by_name(dtype):
    with pytest.raises(KvlabValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype(dtype, torch.float32, CPU, False)


def test_the_interpreter_refuses_half_dtypes_by_name():
    with pytest.raises(KvlabValueError, match="dtype='bfloat16': Triton's interpreter"):
        resolve_dtype("bfloat16", torch.bfloat16, CPU, interpreter=True)


def test_the_checkpoint_dtype_is_config_jsons_else_the_weights(tiny_llama_dir, tmp_path):
    import shutil

    assert checkpoint_dtype(TINY_MODEL_DIR) == torch.bfloat16  # "dtype": "bfloat16"
    assert checkpoint_dtype(tiny_llama_dir) == torch.float32   # save_pretrained of a float32 model
    copy = shutil.copytree(tiny_llama_dir, tmp_path / "no-dtype")
    config = json.loads((copy / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (copy / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(copy) == torch.float32  # the safetensors headers say F32


def test_a_bf16_checkpoint_is_served_in_bf16_token_for_token_with_transformers_default_load():
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()  # transformers' default: the checkpoint's dtype
    assert hf.dtype == torch.bfloat16
    eng = LLMEngine(TINY_MODEL_DIR, num_gpu_blocks=16, attention_backend="torch", device="cpu")
    assert eng.engine_config.dtype == torch.bfloat16 and eng.cache_dtype == torch.bfloat16
    assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16}
    prompts = [list(range(5, 25)), list(range(100, 131, 3))]
    outs = eng.generate(prompts, max_tokens=6)
    assert outs == [hf_greedy(hf, p, 6) for p in prompts]


def test_under_the_interpreter_auto_is_float32_and_the_start_up_log_says_so():
    eng = LLMEngine(TINY_MODEL_DIR, num_gpu_blocks=16, attention_backend="triton", device="cpu")
    assert eng.engine_config.dtype == torch.float32
    assert eng.startup_log()[-1].startswith("Upcasting torch.bfloat16 to torch.float32.")


def test_an_mla_engine_on_a_cpu_runs_the_interpreter_so_half_dtypes_are_refused_under_either_backend(
        tiny_deepseek_dir):
    from kvlab import kernels

    if kernels.backend() != kernels.TRITON_INTERPRETER:
        pytest.skip("the MLA kernels compile natively here")
    with pytest.raises(KvlabValueError, match="dtype='bfloat16': Triton's interpreter"):
        LLMEngine(tiny_deepseek_dir, num_gpu_blocks=16, attention_backend="torch", dtype="bfloat16", device="cpu")


def test_gemma3_never_computes_in_float16_as_vllm_refuses_it():
    """vLLM's ``_FLOAT16_NOT_SUPPORTED_MODELS``: ``auto`` skips float16 for Gemma 3, an explicit one is refused."""
    assert resolve_dtype("auto", torch.float16, CPU, False, "gemma3_text") == (
        torch.bfloat16, "Casting torch.float16 to torch.bfloat16.")
    assert resolve_dtype("auto", torch.float16, CPU, False, "llama") == (torch.float16, None)
    with pytest.raises(KvlabValueError, match="'gemma3_text' does not support float16"):
        resolve_dtype("half", torch.bfloat16, CPU, False, "gemma3_text")
