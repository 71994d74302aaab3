"""Seeded workloads and the simulations the notebooks run on ``core`` and ``capacity`` (never the engine).

Notebooks 02, 03, 04 and 07.
"""
