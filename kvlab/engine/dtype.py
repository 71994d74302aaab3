"""The dtype the engine computes in: vLLM 0.33.0's ``--dtype`` rule, with kvlab's two differences stated.

vLLM resolves ``ModelConfig.dtype`` in ``_get_and_verify_dtype`` / ``_resolve_auto_dtype``
(``vllm/config/model.py``): the checkpoint's dtype is ``config.json``'s ``dtype`` (``torch_dtype`` in
older files), else the one dtype of its safetensors weights, else float32
(``ModelArchConfigConvertorBase.get_torch_dtype``). ``"auto"`` keeps that dtype where the platform
supports it (``supported_dtypes``: bf16, fp16, fp32 on Ampere and later GPUs and on x86 CPUs; fp16,
fp32 before Ampere) and falls back to the platform's first supported dtype otherwise; an explicit
``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or ``"float"``, ``"half"``) is taken as given, and a
cast is logged ("Upcasting ...", "Downcasting ...", "Casting ..."). Some families compute wrongly in
float16 (``_FLOAT16_NOT_SUPPORTED_MODELS``, Gemma 3 among them): ``"auto"`` skips float16 for them and an
explicit float16 is refused with vLLM's message.

kvlab differs twice. vLLM downcasts a float32 checkpoint under ``"auto"`` to the platform's first
dtype (bf16); kvlab keeps float32, so its tiny float32 checkpoints compare with transformers'
float32 load token for token. And under Triton's interpreter (a CPU engine with
``attention_backend="triton"``, or serving MLA, whose kernels are Triton's under either backend),
which has no bf16 or fp16 arithmetic, ``"auto"`` is float32 (said in a start-up line) and an
explicit half dtype is refused. On a CPU's torch backend a bf16 checkpoint runs in bf16, as in vLLM.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvlab.engine.config import read_json
from kvlab.errors import KvlabValueError

#: vLLM's ``_STR_DTYPE_TO_TORCH_DTYPE``: the names ``dtype`` accepts besides ``"auto"``.
STR_DTYPE_TO_TORCH_DTYPE = {"half": torch.float16, "float16": torch.float16, "float": torch.float32,
                            "float32": torch.float32, "bfloat16": torch.bfloat16}
_CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_dtype(model_dir: str | os.PathLike) -> torch.dtype:
    """The checkpoint's dtype as vLLM reads it: ``config.json``'s ``dtype`` / ``torch_dtype``, else its weights'."""
    from kvlab.engine.loader import read_weights  # the loader imports the registry, which imports this package

    config = read_json(Path(model_dir) / "config.json")
    declared = config.get("dtype") or config.get("torch_dtype")  # check_config_fields admits only these names
    if declared is not None:
        return _CONFIG_DTYPES[declared]
    floats = {t.dtype for t in read_weights(model_dir, meta=True)[0].values() if t.is_floating_point()}
    if not floats:
        return torch.float32
    common = floats.pop()
    for dtype in floats:
        common = torch.promote_types(common, dtype)
    return common


#: vLLM's ``_FLOAT16_NOT_SUPPORTED_MODELS``: ``model_type`` -> why float16 is refused.
FLOAT16_NOT_SUPPORTED_MODELS = dict.fromkeys(
    ("gemma2", "gemma3", "gemma3_text", "glm4"), "Numerical instability. Please use bfloat16 or float32 instead.")


def supported_dtypes(device: torch.device, model_type: str = "") -> list[torch.dtype]:
    """vLLM's ``current_platform.supported_dtypes``, the preferred first, less float16 where ``model_type``
    cannot use it (``_resolve_auto_dtype``'s filter)."""
    dtypes = [torch.float16, torch.float32] if device.type == "cuda" and not torch.cuda.is_bf16_supported() else \
        [torch.bfloat16, torch.float16, torch.float32]
    return [d for d in dtypes if not (d == torch.float16 and model_type in FLOAT16_NOT_SUPPORTED_MODELS)]


def resolve_dtype(dtype: object, config_dtype: torch.dtype, device: torch.device,
                  interpreter: bool, model_type: str = "") -> tuple[torch.dtype, str | None]:
    """``dtype`` (``"auto"``, a name, or a ``torch.dtype``) resolved as the module says; and the line to log, if any.

    ``interpreter``: the attention kernels run through Triton's interpreter (float32 only). ``model_type``:
    the checkpoint's, for vLLM's float16 refusal (``_check_valid_dtype``).
    """
    if isinstance(dtype, str) and dtype.lower() == "auto":
        supported = supported_dtypes(device, model_type)
        if interpreter:
            chosen = torch.float32
        elif config_dtype == torch.float32 or config_dtype in supported:
            chosen = config_dtype  # kvlab keeps a float32 checkpoint in float32 (vLLM: the platform's first)
        else:
            chosen = supported[0]
    elif isinstance(dtype, str) and dtype.lower() in STR_DTYPE_TO_TORCH_DTYPE:
        chosen = STR_DTYPE_TO_TORCH_DTYPE[dtype.lower()]
    elif isinstance(dtype, torch.dtype) and dtype in STR_DTYPE_TO_TORCH_DTYPE.values():
        chosen = dtype
    else:
        raise KvlabValueError(f"dtype must be 'auto' or one of {', '.join(map(repr, STR_DTYPE_TO_TORCH_DTYPE))}, "
                              f"got {dtype!r}")
    if chosen == torch.float16 and model_type in FLOAT16_NOT_SUPPORTED_MODELS:
        raise KvlabValueError(f"dtype={dtype!r}: The model type {model_type!r} does not support float16. Reason: "
                              f"{FLOAT16_NOT_SUPPORTED_MODELS[model_type]}")
    if interpreter and chosen != torch.float32:
        raise KvlabValueError(f"dtype={dtype!r}: Triton's interpreter (attention_backend='triton' or MLA on a CPU) "
                              "has no bf16 or fp16 arithmetic; use dtype='float32' (or attention_backend='torch')")
    return chosen, _cast_line(config_dtype, chosen, interpreter)


def _cast_line(config_dtype: torch.dtype, chosen: torch.dtype, interpreter: bool) -> str | None:
    """vLLM's log line for a cast (none when the checkpoint's dtype is kept); kvlab adds why, under the interpreter."""
    if chosen == config_dtype:
        return None
    verb = "Upcasting" if chosen == torch.float32 else "Downcasting" if config_dtype == torch.float32 else "Casting"
    why = " (dtype='auto' under Triton's interpreter, which computes in float32 only)" if interpreter else ""
    return f"{verb} {config_dtype} to {chosen}.{why}"
