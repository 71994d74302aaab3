"""Broken copies of the kernels, on purpose: one plausible bug each, to show what catches it.

A *mutant* is a single-line change to one kernel file (``kernels/attention.py``,
``cache_write.py``, ``mla_decode.py`` or ``mla_cache_write.py``) of the kind a learner (or a
maintainer) could write: forgetting the online-softmax rescale, a causal mask off by one, the
wrong query head for a packed row, a sliding window one key too wide, and so on. ``load_mutant(name)`` writes
the changed source to a scratch file and imports it as a module of its own, so the real kernels
stay untouched; its ``paged_attention_triton`` has ``paged_attention``'s signature, ready for
``check_kernel`` or for ``using_kernels`` (which makes the engine call it). ``load_kernel_file``
does the same for a learner's own copy of a kernel file. Every mutant stays inside the tensors it
was given (a read past a block table could crash the interpreter): a bug shows as wrong numbers.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from kvlab.errors import KernelInputError, UnknownNameError

#: Where mutants read the kernel sources: this folder, or ``$KVLAB_KERNEL_SOURCES`` when set. The mutation
#: suite (``scripts/mutation.py``) runs the tests on a scratch copy whose kernel may itself be a mutant; it
#: points this at the unchanged sources, so that a mutant shown by a test is always one change from them.
KERNEL_DIR = Path(os.environ.get("KVLAB_KERNEL_SOURCES") or Path(__file__).parent)


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One bug: ``original`` (exactly one line or expression of ``kernels/<module>.py``) becomes ``mutated``."""

    name: str
    module: str           # the file under kernels/: "attention", "cache_write", "mla_decode", "mla_cache_write"
    original: str
    mutated: str
    bug: str              # what the broken kernel believes, in a learner's words

    def source(self) -> str:
        """The whole module's source with this one change applied."""
        text = (KERNEL_DIR / f"{self.module}.py").read_text()
        if text.count(self.original) != 1:
            raise KernelInputError(
                f"mutant {self.name!r}: its original text occurs {text.count(self.original)} times in "
                f"kernels/{self.module}.py (it must occur exactly once): {self.original!r}"
            )
        return text.replace(self.original, self.mutated)


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("no_rescale", "attention",
           "acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)",
           "acc = acc + dot(p.to(v.dtype), v)",
           "the values summed so far need no rescaling when a later tile raises the maximum"),
    Mutant("no_empty_row_guard", "attention",
           'm_ref = tl.where(m_new == float("-inf"), 0.0, m_new)',
           "m_ref = m_new",
           "every row sees a key in every tile it visits (so m is never -inf and -inf - -inf never happens)"),
    Mutant("causal_off_by_one", "attention",
           "visible = visible & (key_pos[None, :] <= q_abs[:, None])",
           "visible = visible & (key_pos[None, :] < q_abs[:, None])",
           "a query sees the keys before it, but not its own"),
    Mutant("gqa_head_mapping", "attention",
           "q_head = kv_head * GROUP + rows % GROUP",
           "q_head = kv_head + rows % GROUP * NUM_KV_HEADS",
           "query head h reads KV head h % num_kv_heads (interleaved), not h // group"),
    Mutant("tile_to_block", "attention",
           "block_row + key_pos // BLOCK_SIZE, mask=key_ok",
           "block_row + tile * TILE_N // BLOCK_SIZE + 0 * offs_n, mask=key_ok",
           "all the keys of a tile live in one block (true only while a tile is no larger than a block)"),
    Mutant("merge_weights", "attention",
           "out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)",
           "out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s, axis=0)",
           "the splits' sums can be added as they are; only their values need the log-sum-exp weights"),
    Mutant("fp8_scale_direction", "attention",
           "k = k.to(tl.float32) * k_scale",
           "k = k.to(tl.float32) / k_scale",
           "the cache holds x * scale, so a load divides by the scale"),
    Mutant("cache_write_offset", "cache_write",
           "offset = slot % BLOCK_SIZE",
           "offset = (slot + 1) % BLOCK_SIZE",
           "offsets inside a block count from 1"),
    Mutant("window_off_by_one", "attention",
           "visible = visible & (q_abs[:, None] - key_pos[None, :] < SLIDING_WINDOW)",
           "visible = visible & (q_abs[:, None] - key_pos[None, :] <= SLIDING_WINDOW)",
           "a window of W keys reaches W keys back from the query, so it holds W + 1"),
    Mutant("mla_rope_dropped", "mla_decode",
           "scores = (dot(q_lat, tl.trans(c_kv)) + dot(q_pe, tl.trans(k_pe))) * scale",
           "scores = dot(q_lat, tl.trans(c_kv)) * scale",
           "after absorption the latent part is the whole score; the rope part can be left out"),
    Mutant("mla_latent_write_offset", "mla_cache_write",
           "tl.store(dst + KV_LORA_RANK + rope,",
           "tl.store(dst + rope,",
           "k_pe goes at the start of its slot (over c_kv), not after the kv_lora_rank latent values"),
]}


def get_mutant(name: str) -> Mutant:
    """The mutant called ``name``; an unknown name raises and lists the known ones."""
    if name not in MUTANTS:
        raise UnknownNameError("name", name, MUTANTS)
    return MUTANTS[name]


@functools.cache
def _scratch_dir() -> Path:
    """One scratch folder per process for the modules loaded here (Triton reads a kernel's source from its file).

    Removed when the process exits, so test runs and notebooks leave nothing in the temp folder.
    """
    path = Path(tempfile.mkdtemp(prefix="kvlab-kernels-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def load_kernel_source(text: str, stem: str = "kernel") -> ModuleType:
    """Import ``text`` (the source of a kernel module) as a fresh module of its own; the same text loads once.

    The module's kernels are decorated for this process's backend (``require_triton`` runs in it
    as in the real module), and its imports of ``kvlab.kernels`` share the real checks and grid.
    """
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    name = f"kvlab_kernels_copy_{stem}_{digest}"
    path = _scratch_dir() / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # Triton (and dataclasses) look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_kernel_file(path: str | os.PathLike) -> ModuleType:
    """Import a learner's own copy of a kernel file (say, an edited ``attention.py``) beside the real one."""
    file = Path(path)
    if not file.is_file():
        raise KernelInputError(f"path must name a kernel source file, got {str(path)!r} (no such file)")
    return load_kernel_source(file.read_text(), file.stem.replace("-", "_"))


def load_mutant(name: str) -> ModuleType:
    """The kernel module with mutant ``name`` applied, imported from a scratch copy."""
    mutant = get_mutant(name)
    return load_kernel_source(mutant.source(), f"{mutant.module}_{mutant.name}")


def mutant_attention(name: str) -> Callable:
    """``paged_attention`` as mutant ``name`` computes it (an attention mutant: ``module == "attention"``)."""
    mutant = get_mutant(name)
    if mutant.module != "attention":
        raise KernelInputError(f"mutant {name!r} changes kernels/{mutant.module}.py, not the attention kernel")
    kernel = load_mutant(name).paged_attention_triton

    @functools.wraps(kernel)
    def paged_attention(*args, **kwargs):
        return kernel(*args, **kwargs)

    paged_attention.__qualname__ = f"paged_attention with mutant {name!r}"
    return paged_attention


@contextlib.contextmanager
def using_kernels(*, paged_attention: Callable | None = None,
                  reshape_and_cache: Callable | None = None) -> Iterator[None]:
    """Inside the block, ``kvlab.kernels.paged_attention`` (and/or ``reshape_and_cache``) is the function given.

    The engine's attention layer looks both up on ``kvlab.kernels`` at every call, so a whole
    engine runs on a mutant (or on a learner's kernel) for the duration of the block, and on the
    real kernels again after it, even if the block raises.
    """
    kernels = sys.modules["kvlab.kernels"]
    swaps = {k: v for k, v in (("paged_attention", paged_attention), ("reshape_and_cache", reshape_and_cache))
             if v is not None}
    originals = {name: getattr(kernels, name) for name in swaps}
    try:
        for name, fn in swaps.items():
            setattr(kernels, name, fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)
