"""Copied by scripts/mutation.py into a scratch copy of kvlab, first on PYTHONPATH: every Python process of a
mutant's run (pytest, each notebook's Jupyter kernel, each subprocess a test starts) logs where it imports
``kvlab`` and ``kvlab.kernels`` from, and refuses to import them from anywhere but the scratch copy.

A mutant "killed" by the unmutated package would be worse than none, so the runner reads the log after
every run and stops the whole suite on any ``FAIL`` line. With ``KVLAB_MUTATION_SEED`` it also seeds
``random`` in every process. Outside a mutation run (no ``KVLAB_MUTATION_SCRATCH``) this file does nothing.
"""

import os
import sys

_ROOT = os.environ.get("KVLAB_MUTATION_SCRATCH")
_LOG = os.environ.get("KVLAB_MUTATION_LOG")
_WATCHED = ("kvlab", "kvlab.kernels")


def _inside(path):
    root = os.path.realpath(_ROOT) + os.sep
    return bool(path) and os.path.realpath(path).startswith(root)


def _write(line):
    with open(_LOG, "a") as log:
        log.write(f"{os.getpid()} {line} {' '.join(sys.argv[:3])}\n")


class _ScratchWatch:
    """A meta-path finder in front of all others: it asks them where a watched package is, and checks."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in _WATCHED:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is cls or find is None:
                continue
            spec = find(name, path, target)
            if spec is None:
                continue
            if not _inside(spec.origin):
                _write(f"FAIL {name} {spec.origin}")
                raise ImportError(f"mutation suite: {name} would be imported from {spec.origin}, "
                                  f"not from the scratch copy {_ROOT}")
            _write(f"OK {name} {spec.origin}")
            return spec
        _write(f"FAIL {name} not found")
        return None


if _ROOT and _LOG:
    sys.meta_path.insert(0, _ScratchWatch)
    if os.environ.get("KVLAB_MUTATION_SEED"):
        # Fresh seeds (kvlab.kernels.batches.fresh_seed, random draws in tests) repeat from run to run: a kill
        # that only some seeds give then shows again when the killer is rerun on the unmutated copy (unconfirmed).
        import random

        random.seed(int(os.environ["KVLAB_MUTATION_SEED"]))
