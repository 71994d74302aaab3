"""The kernels are valid GPU Triton: they compile to a cubin for an H100/H200 (sm_90), even here.

The interpreter runs code a GPU compiler would reject (a tl.dot tile under 16, a loop-carried
type that changes). Triton's wheel ships ptxas, so ``kvlab.kernels.compile_check`` compiles every
kernel variant ahead of time in a fresh process where Triton compiles instead of interpreting.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build has no NVIDIA backend")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(KVLAB_KERNEL_BACKEND="torch", TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-m", "kvlab.kernels.compile_check", "--arch", "90", "--json"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    assert len(rows) >= 10
    assert all(r["shared_bytes"] <= 227 * 1024 for r in rows)                 # fits an H100/H200 SM
