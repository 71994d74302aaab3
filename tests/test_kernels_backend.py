"""Which backend runs the kernels, and how it is set up before Triton decorates anything.

Triton 3.9 decides "interpret or compile" when ``@triton.jit`` decorates a function, not at
import; triton's own helpers (``tl.max``, ``tl.sum``, ``tl.cdiv``) are decorated when triton is
imported. The subprocess tests below start fresh interpreters to check each way a process can
arrive at ``import kvlab.kernels``.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kvlab.kernels import (
    BACKENDS,
    TORCH_REFERENCE,
    TRITON_CUDA,
    TRITON_INTERPRETER,
    backend,
    default_device,
    device_for,
)
from kvlab.kernels._backend import choose_backend
from kvlab.kernels.checks import check_kernel_device

from kvlab.errors import BackendUnavailableError, KernelInputError, UnknownNameError

ON_GPU = backend() == TRITON_CUDA

SMALL_BATCH = """
import torch
q = torch.randn(3, 4, 64); kc = torch.randn(4, 16, 2, 64); vc = torch.randn(4, 16, 2, 64)
bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
sl = torch.tensor([20, 2], dtype=torch.int32); qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
out = K.paged_attention(q, kc, vc, bt, sl, qsl, num_kv_splits=2)
ref = K.paged_attention_ref(q, kc, vc, bt, sl, qsl)
assert ((out - ref).norm() / ref.norm()) < 1e-5
kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
K.reshape_and_cache(q[:, :2], q[:, 2:], kc2, vc2, torch.tensor([5, -1, 40]))
assert torch.equal(kc2[0, 5], q[0, :2]) and torch.equal(vc2[2, 8], q[2, 2:])
"""


def run_python(*parts: str, **env: str) -> str:
    """Run the code ``parts`` in a fresh interpreter (no kvlab or triton imported yet); return its stdout."""
    clean = {k: v for k, v in os.environ.items() if k not in ("KVLAB_KERNEL_BACKEND", "TRITON_INTERPRET")}
    code = "\n".join(textwrap.dedent(part) for part in parts)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**clean, **env}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(("requested", "triton", "cuda", "interpret", "expected"), [
    ("auto", True, True, False, TRITON_CUDA),
    ("auto", True, False, False, TRITON_INTERPRETER),
    ("auto", True, True, True, TRITON_INTERPRETER),         # the user asked for TRITON_INTERPRET=1
    ("auto", False, True, False, TORCH_REFERENCE),          # macOS, or triton missing
    ("interpreter", True, True, False, TRITON_INTERPRETER),
    ("torch", True, True, False, TORCH_REFERENCE),
    ("cuda", True, True, False, TRITON_CUDA),
])
def test_choose_backend(requested, triton, cuda, interpret, expected):
    assert choose_backend(requested, triton_available=triton, cuda_available=cuda,
                          interpret_requested=interpret) == expected


@pytest.mark.parametrize(("requested", "triton", "cuda", "message"), [
    ("cuda", True, False, "needs a CUDA device"),
    ("cuda", False, True, "needs Triton"),
    ("interpreter", False, False, "needs Triton"),
])
def test_a_forced_backend_this_machine_cannot_run_is_refused(requested, triton, cuda, message):
    with pytest.raises(BackendUnavailableError, match=message):
        choose_backend(requested, triton_available=triton, cuda_available=cuda)


def test_an_unknown_backend_name_lists_the_choices():
    with pytest.raises(UnknownNameError, match="auto, cuda, interpreter, torch"):
        choose_backend("gpu", triton_available=True, cuda_available=False)


def test_importing_kvlab_and_its_exercises_never_imports_triton():
    run_python("""
        import sys
        import kvlab, kvlab.exercises, kvlab.exercises.nb05
        assert "triton" not in sys.modules and "kvlab.kernels" not in sys.modules, sorted(sys.modules)
    """)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the interpreter is not chosen")
def test_kernels_still_interpret_when_triton_was_imported_first():
    # torch._dynamo (torch.compile, Hugging Face model classes) imports triton before kvlab can set
    # TRITON_INTERPRET, so tl.max/tl.sum/tl.cdiv are compiled-mode functions; a knob set in code
    # would also override the variable.
    out = run_python("""
        import sys, torch._dynamo, triton
        assert "triton" in sys.modules
        triton.knobs.runtime.interpret = False
        import kvlab.kernels as K
        from kvlab.kernels.attention import paged_attention_kernel
        assert K.backend() == "triton-interpreter", K.backend()
        assert type(paged_attention_kernel).__name__ == "InterpretedFunction"
    """, SMALL_BATCH, "print('ok')")
    assert out.strip() == "ok"


def test_without_triton_the_reference_runs_and_says_so():
    out = run_python("""
        import sys
        sys.modules["triton"] = None                     # as on macOS: `import triton` fails
        import kvlab.kernels as K
        assert K.backend() == "torch-reference"
        from kvlab.errors import BackendUnavailableError
        try:
            import kvlab.kernels.cache_write
        except BackendUnavailableError as e:
            print("refused:", e)
    """, SMALL_BATCH, "print(K.describe_backend())")
    assert "refused: the kernels need Triton" in out
    assert "torch-reference: Triton is not installed here" in out


def test_the_environment_variable_forces_a_backend():
    out = run_python("""
        import sys
        import kvlab.kernels as K
        print(K.backend(), "triton" in sys.modules)
    """, SMALL_BATCH, KVLAB_KERNEL_BACKEND="torch")
    assert out.split() == ["torch-reference", "False"]            # forced torch: triton is not even imported
    if not ON_GPU:
        with pytest.raises(AssertionError, match="BackendUnavailableError: KVLAB_KERNEL_BACKEND=cuda needs a CUDA"):
            run_python("import kvlab.kernels", KVLAB_KERNEL_BACKEND="cuda")


def test_each_backend_names_the_device_its_tensors_live_on():
    assert [device_for(name) for name in BACKENDS] == ["cuda", "cpu", "cpu"]
    assert default_device() == device_for(backend())
    with pytest.raises(UnknownNameError, match="triton-cuda"):
        device_for("cuda")


def test_native_kernels_refuse_cpu_tensors_with_a_clear_error():
    with pytest.raises(KernelInputError, match=r"CUDA tensors, got tensors on cpu.*default_device\(\)"):
        check_kernel_device(TRITON_CUDA, torch.device("cpu"))
    check_kernel_device(TRITON_INTERPRETER, torch.device("cpu"))      # the interpreter reads host memory
    check_kernel_device(TORCH_REFERENCE, torch.device("cpu"))
