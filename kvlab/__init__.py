"""kvlab: the code behind a workbook on how LLM serving engines manage the KV cache.

Each module holds one concept, named as vLLM V1 names it, so a learner can open
``vllm/v1/core/`` next. The notebooks in ``notebooks/`` tell the story and import
everything from here.
"""

from kvlab.errors import KvlabError, KvlabValueError
from kvlab.models import ModelSpec, get_model, list_models
from kvlab.sizing import kv_bytes, kv_bytes_per_token
from kvlab.units import GiB, KiB, MiB, format_bytes

__all__ = [
    "GiB",
    "KiB",
    "KvlabError",
    "KvlabValueError",
    "MiB",
    "ModelSpec",
    "format_bytes",
    "get_model",
    "kv_bytes",
    "kv_bytes_per_token",
    "list_models",
]

__version__ = "0.1.0"
