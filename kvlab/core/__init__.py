"""The allocator and the scheduler, mirroring ``vllm/v1/core/`` (vLLM 0.33.0) file by file.

Bookkeeping only: block ids, reference counts, hashes and token counts, never a tensor, so nothing
here imports torch, the engine, the kernels or the pictures. Notebooks 03, 04, 06, 07 and 08.
"""
