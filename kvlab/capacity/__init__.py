"""Capacity arithmetic: bytes per token from real configs, vLLM's memory budget, GPUs, costs, the playbook.

Pure arithmetic on ``config.json`` fields and datasheet numbers: nothing here imports torch. The source
articles' figures live in ``data/source_figures.json``, each with the kvlab function that computes it.
Notebooks 01, 02 and 07.
"""
