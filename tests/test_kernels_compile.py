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
from kvlab.kernels.compile_check import jit_sources

from kvlab import kernels
from kvlab.errors import KernelInputError

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_check(*args):
    """Run ``python -m kvlab.kernels.compile_check --arch 90 --json *args`` where Triton compiles; its rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(KVLAB_KERNEL_BACKEND="torch", TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-m", "kvlab.kernels.compile_check", "--arch", "90", "--json", *args],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build has no NVIDIA backend")
def test_every_kernel_compiles_for_sm90():
    rows = compile_check()
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    assert len(rows) >= 12 and any("sliding window" in r["variant"] for r in rows)
    assert all(r["shared_bytes"] <= 227 * 1024 for r in rows)                 # fits an H100/H200 SM


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build has no NVIDIA backend")
def test_a_learners_kernel_file_is_compiled_in_place_of_the_packages(tmp_path):
    # A running maximum kept in float16 while the update returns float32: the interpreter runs it,
    # a GPU compiler refuses the loop-carried type change.
    source = (Path(kernels.__file__).parent / "attention.py").read_text()
    original = 'm_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)'
    assert source.count(original) == 1
    mine = tmp_path / "my_attention.py"
    mine.write_text(source.replace(original, original.replace("tl.float32", "tl.float16")))
    (row,) = compile_check("--only", "decode bf16, 4 splits", str(mine))
    assert not row["ok"] and row["variant"] == "decode bf16, 4 splits"
    (good,) = compile_check("--only", "decode bf16, 4 splits", str(Path(kernels.__file__).parent / "attention.py"))
    assert good["ok"]


def test_a_learners_file_replaces_the_functions_it_defines(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text("import triton\n\n\n@triton.jit\ndef dot(a, b):\n    return a\n\n\ndef helper():\n    pass\n")
    sources = jit_sources([mine])
    assert sources["dot"].endswith("return a\n") and "helper" not in sources
    assert "paged_attention_kernel" in sources and "reshape_and_cache_kernel" in sources
    with pytest.raises(KernelInputError, match="no such file"):
        jit_sources([tmp_path / "missing.py"])
