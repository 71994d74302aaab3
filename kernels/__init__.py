"""kvlab.kernels: Triton paged-attention kernels (filled in by notebook 05's work)."""
