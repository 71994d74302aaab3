"""A pytest plugin of the mutation suite (``-p kvlab_mutation_order``): the likely killers run first.

``KVLAB_MUTATION_FIRST`` lists node-id prefixes (``tests/test_blocks.py``), separated by ``os.pathsep``:
their tests run first, in that order; then the rest in pytest's order, with ``KVLAB_MUTATION_LAST``'s
prefixes (the slow engine tests) at the end. A run stops at its first failure (``-x``), so the order
decides how long a killed mutant takes, never whether it is killed.
"""

import os

# Imported here, as pytest loads this plugin (-p), before any conftest: the root conftest.py makes pytest put the
# repository first on sys.path, where kvlab would then be found instead of the scratch copy. Once imported from
# the scratch copy, every later ``import kvlab...`` finds it in sys.modules, and its subpackages under its __path__.
import kvlab  # noqa: F401,E402


def _prefixes(name):
    return [p for p in os.environ.get(name, "").split(os.pathsep) if p]


def pytest_collection_modifyitems(session, config, items):
    first, last = _prefixes("KVLAB_MUTATION_FIRST"), _prefixes("KVLAB_MUTATION_LAST")

    def rank(item):
        for i, prefix in enumerate(first):
            if item.nodeid.startswith(prefix):
                return i
        return len(first) + any(item.nodeid.startswith(p) for p in last)

    items[:] = sorted(items, key=rank)  # stable: pytest's order inside each rank
