"""Which implementation runs the kernels: Triton on a GPU, Triton's interpreter on CPU, or torch.

How Triton 3.x decides to interpret (read in ``triton/runtime/jit.py`` and ``triton/knobs.py``):
``@triton.jit`` looks at ``triton.knobs.runtime.interpret`` *when it decorates a function*. That
knob reads the environment variable ``TRITON_INTERPRET`` at each access, unless code has assigned
the knob directly, which then wins over the variable. Importing triton fixes nothing, so the one
thing that matters is the state at the moment our kernel modules are imported and decorate their
kernels. ``prepare_triton`` sets both the variable and (if triton is already imported) the knob
before that happens. ``import torch`` does not import triton on a CPU build; ``import
torch._dynamo`` (``torch.compile``) does, which is harmless for the reason above.

The choice is made once per process: a decorated kernel cannot change its kind afterwards.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

from kvlab.errors import BackendUnavailableError, UnknownNameError

#: Set to ``cuda``, ``interpreter`` or ``torch`` to force a backend (``auto``, the default, picks).
BACKEND_ENV = "KVLAB_KERNEL_BACKEND"
TRITON_CUDA = "triton-cuda"
TRITON_INTERPRETER = "triton-interpreter"
TORCH_REFERENCE = "torch-reference"
BACKENDS = (TRITON_CUDA, TRITON_INTERPRETER, TORCH_REFERENCE)
_REQUESTS = {"auto": None, "cuda": TRITON_CUDA, "interpreter": TRITON_INTERPRETER, "torch": TORCH_REFERENCE}


def choose_backend(requested: str, *, triton_available: bool, cuda_available: bool,
                   interpret_requested: bool = False) -> str:
    """The backend for a request (``auto``/``cuda``/``interpreter``/``torch``) on a machine like this.

    ``auto`` takes native Triton on a CUDA device, the interpreter without one (or when the user
    already set ``TRITON_INTERPRET=1``), and the torch reference when Triton is not installed.
    A forced backend that this machine cannot run raises ``BackendUnavailableError``.
    """
    if requested not in _REQUESTS:
        raise UnknownNameError(BACKEND_ENV, requested, _REQUESTS)
    wanted = _REQUESTS[requested]
    if wanted is None:
        if not triton_available:
            return TORCH_REFERENCE
        return TRITON_CUDA if cuda_available and not interpret_requested else TRITON_INTERPRETER
    if wanted != TORCH_REFERENCE and not triton_available:
        raise BackendUnavailableError(
            f"{BACKEND_ENV}={requested} needs Triton, which is not installed here "
            "(Triton publishes Linux wheels only); use 'torch' or 'auto'"
        )
    if wanted == TRITON_CUDA and not cuda_available:
        raise BackendUnavailableError(
            f"{BACKEND_ENV}=cuda needs a CUDA device and a CUDA build of torch; "
            "use 'interpreter' to run the same kernels on CPU"
        )
    return wanted


def prepare_triton(chosen: str) -> None:
    """Make the next ``@triton.jit`` decorations compile (``triton-cuda``) or interpret."""
    interpret = chosen == TRITON_INTERPRETER
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    if "triton" in sys.modules:  # imported earlier: a knob assigned in code would beat the variable
        sys.modules["triton"].knobs.runtime.interpret = interpret


@functools.cache
def backend() -> str:
    """``"triton-cuda"``, ``"triton-interpreter"`` or ``"torch-reference"``: what runs the kernels here.

    Decided on first use from ``KVLAB_KERNEL_BACKEND`` (default ``auto``), whether Triton is
    installed and whether torch sees a CUDA device; Triton is set up accordingly before any
    kvlab kernel is decorated. The answer stays the same for the life of the process.
    """
    import torch

    requested = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    chosen = choose_backend(
        requested,
        triton_available=importlib.util.find_spec("triton") is not None,
        cuda_available=torch.cuda.is_available(),
        interpret_requested=os.environ.get("TRITON_INTERPRET", "0").strip() == "1",
    )
    if chosen != TORCH_REFERENCE:
        prepare_triton(chosen)
    return chosen


def require_triton() -> str:
    """The Triton backend in use, for modules that define kernels; raises if the torch reference is in use."""
    chosen = backend()
    if chosen == TORCH_REFERENCE:
        raise BackendUnavailableError(
            "the kernels need Triton, but this process runs the torch reference "
            f"(Triton missing, or {BACKEND_ENV}=torch); kvlab.kernels.paged_attention and "
            "reshape_and_cache still work and run the reference"
        )
    return chosen


def describe_backend(name: str | None = None) -> str:
    """One sentence for a learner: what runs the kernels, and what would run elsewhere."""
    name = name or backend()
    if name == TRITON_CUDA:
        import torch

        return (f"triton-cuda: the Triton kernels are compiled for {torch.cuda.get_device_name(0)} "
                "and run natively.")
    if name == TRITON_INTERPRETER:
        return ("triton-interpreter: no GPU here, so Triton's interpreter (TRITON_INTERPRET=1) runs the "
                "same kernels on CPU tensors, one program after another: exact, and slow. On a CUDA "
                "machine the same source compiles and runs natively.")
    return ("torch-reference: Triton is not installed here, so kvlab.kernels runs its torch reference "
            "(same answers, none of the kernel's tiling). Install triton on Linux to run the kernels.")
