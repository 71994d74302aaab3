"""Where kvlab's data files live: ``data/`` beside the package, or ``$KVLAB_DATA`` when set.

``TINY_MODEL_DIR`` is the committed checkpoint the notebooks serve (a 4.2M-parameter Llama trained
on Python's documentation by ``scripts/train_tiny_model.py``; its README says how and how well).
``chat_prompt`` writes a prompt in its training format, the text its ``chat_template.jinja`` makes.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(os.environ.get("KVLAB_DATA", Path(__file__).resolve().parents[1] / "data"))
#: The trained checkpoint: config.json, model.safetensors, tokenizer.json, generation_config.json.
TINY_MODEL_DIR = DATA_DIR / "tiny-pydoc-llama"
#: The system prompt of every training turn (``scripts/train_tiny_model.py``'s ``SYSTEM_PROMPT``).
TINY_MODEL_SYSTEM_PROMPT = "You are a helpful assistant for Python's documentation."


def chat_prompt(question: str, system: str = TINY_MODEL_SYSTEM_PROMPT) -> str:
    """One system and one user turn, then the assistant's tag: what ``apply_chat_template(...,
    add_generation_prompt=True)`` gives for the trained model, without loading a tokenizer."""
    return f"<|system|>\n{system}\n<|user|>\n{question}\n<|assistant|>\n"
