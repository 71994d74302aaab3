"""Which implementation runs the kernels: Triton on a GPU, Triton's interpreter on CPU, or torch.

How Triton 3.x decides to interpret (read in ``triton/runtime/jit.py`` and ``triton/knobs.py``):
``@triton.jit`` looks at ``triton.knobs.runtime.interpret`` *when it decorates a function*. That
knob reads the environment variable ``TRITON_INTERPRET`` at each access, unless code has assigned
the knob directly, which then wins over the variable. Importing triton fixes nothing, so the one
thing that matters is the state at the moment our kernel modules are imported and decorate their
kernels. ``prepare_triton`` sets both the variable and (if triton is already imported) the knob
before that happens. ``import torch`` does not import triton on a CPU build; ``import
torch._dynamo`` (``torch.compile``) does, which is harmless for the reason above.

One trap remains: Triton's own library functions (``tl.max``, ``tl.sum``, ``tl.cdiv``, ... in
``triton/language/standard.py``) are ``@jit`` functions too, decorated when triton is imported. If
something imported triton before the interpreter was switched on (``import torch._dynamo`` does,
and so does importing a Hugging Face model class), they are compiled-mode functions, and an
interpreted kernel that calls them fails with "Cannot call @triton.jit'd outside of the scope of a
kernel". ``prepare_triton`` then re-wraps them for the interpreter (``_interpret_triton_library``).

The choice is made once per process: a decorated kernel cannot change its kind afterwards.
"""

from __future__ import annotations

import functools
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
    triton = sys.modules.get("triton")
    if triton is not None:  # imported earlier: a knob assigned in code would beat the variable
        triton.knobs.runtime.interpret = interpret
        if interpret:
            _interpret_triton_library()


def _interpret_triton_library() -> int:
    """Swap triton.language's compiled-mode ``@jit`` helpers for interpreted ones; returns how many.

    Needed only when triton was imported before ``TRITON_INTERPRET`` was set. The helpers call
    each other through their modules' globals and are also bound as ``tl.tensor`` methods, so
    every such reference is replaced (with one interpreted wrapper per function).
    """
    from triton.language import tensor
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    modules = [m for name, m in list(sys.modules.items())
               if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    count = 0
    for owner in [*modules, tensor]:
        for name, value in list(vars(owner).items()):
            if isinstance(value, JITFunction):
                setattr(owner, name, wrapped.setdefault(id(value), InterpretedFunction(value.fn)))
                count += 1
    return count


def _import_triton() -> bool:
    """Whether triton imports here (installed, and built for this platform)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def backend() -> str:
    """``"triton-cuda"``, ``"triton-interpreter"`` or ``"torch-reference"``: what runs the kernels here.

    Decided on first use from ``KVLAB_KERNEL_BACKEND`` (default ``auto``), whether torch sees a
    CUDA device and whether triton imports. ``TRITON_INTERPRET`` is set before triton's first
    import where that is still ahead, and Triton is set up before any kvlab kernel is decorated.
    The answer stays the same for the life of the process.
    """
    import torch

    requested = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    machine = dict(cuda_available=torch.cuda.is_available(),
                   interpret_requested=os.environ.get("TRITON_INTERPRET", "0").strip() == "1")
    if choose_backend(requested, triton_available=True, **machine) == TORCH_REFERENCE:
        return TORCH_REFERENCE                                   # asked for torch: leave triton alone
    previous = os.environ.get("TRITON_INTERPRET")
    prepare_triton(choose_backend(requested, triton_available=True, **machine))
    chosen = choose_backend(requested, triton_available=_import_triton(), **machine)
    if chosen == TORCH_REFERENCE:                                # no triton after all: undo the flag
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
        return chosen
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


def device_for(name: str) -> str:
    """Where tensors for backend ``name`` live: ``"cuda"`` for native Triton, else ``"cpu"``.

    Native kernels read GPU memory only; the interpreter and the reference run on CPU tensors.
    """
    if name not in BACKENDS:
        raise UnknownNameError("backend", name, BACKENDS)
    return "cuda" if name == TRITON_CUDA else "cpu"


def default_device() -> str:
    """The device the kernels of this process want their tensors on (``"cuda"`` or ``"cpu"``)."""
    return device_for(backend())


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
    return ("torch-reference: Triton is not installed here (or KVLAB_KERNEL_BACKEND=torch asked for the "
            "reference), so kvlab.kernels runs its torch reference: the same answers, none of the kernel's "
            "tiling. Install triton on Linux to run the kernels.")
