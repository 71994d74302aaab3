"""Every "vLLM does this here" in the workbook, checked against the installed vLLM 0.33.0 source.

``citations.find_claims`` reads the notebooks, kvlab's and kernels' docstrings and comments,
``README.md`` and ``GLOSSARY.md``; each path, identifier, CLI flag, environment variable,
metric and log format presented as vLLM's must exist in 0.33.0 with that spelling (or, where the text says
0.33.0 dropped it, be absent), and a statement about an older revision must name it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vLLM 0.33.0 is not installed here: run make test-vllm")
from citations import Claim, find_claims, unresolved

#: kvlab's own names that look like vLLM's (each is kvlab's, not a claim about vLLM).
ALLOWLIST = {
    ("env", "VLLM_VERSION"),  # kvlab.VLLM_VERSION: the release kvlab follows
    ("env", "VLLM_MAX_NUM_BATCHED_TOKENS"),  # kvlab.capacity.hybrid's constant for EngineArgs' default
}

#: Stale statements another branch fixes: fixed on branch b-config. The lead empties this list after merging it.
KNOWN_PENDING: set[tuple[str, str]] = set()  # b-config fixed every entry it held


def pending(claim: Claim) -> bool:
    """Listed in ``KNOWN_PENDING`` (by notebook cell, or by module whatever its line)."""
    return (claim.source.split(" line ")[0], claim.text) in KNOWN_PENDING


@pytest.fixture(scope="module")
def claims() -> list[Claim]:
    return find_claims()


def test_the_workbook_cites_vllm_often_enough_for_the_check_to_mean_something(claims):
    kinds = {c.kind for c in claims}
    assert len(claims) > 300 and {"path", "identifier", "flag", "env", "metric", "csrc", "log"} <= kinds


def test_every_citation_resolves_in_vllm_0_33_0(claims):
    problems = []
    for claim in claims:
        why = unresolved(claim)
        if why and (claim.kind, claim.text) not in ALLOWLIST and not pending(claim):
            problems.append(f"{why}: {claim}")
    assert not problems, f"{len(problems)} unresolved citations:\n" + "\n".join(problems)


def test_known_pending_entries_are_still_pending(claims):
    """An entry fixed at its source leaves the list: the list holds only what is still wrong."""
    stale = {(c.source.split(" line ")[0], c.text) for c in claims if unresolved(c)}
    assert stale >= KNOWN_PENDING, sorted(KNOWN_PENDING - stale)


@pytest.mark.parametrize(("text", "why"), [
    ("vLLM's `_report_kv_cache_config` logs it", "not defined anywhere"),
    ("see `vllm/beam_search.py`", "no such path"),
    ("vLLM's `--calculate-kv-scales` flag", "no such CLI flag"),
    ("set `VLLM_ATTENTION_BACKEND`", "no such environment variable"),
    ("`vllm:time_per_output_token_seconds` is exported", "no such metric"),
    ("the kernel in `csrc/attention/attention_kernels.cuh`", "name the revision"),
    ("`vllm/v1/core/block_pool.py:120` frees it", "line number"),
    ("0.33.0 has no `FreeKVCacheBlockQueue`", "said to be absent"),
    ('vLLM logs "Model loading took %s GB and %.2f seconds"', "no log line"),
])
def test_the_checker_catches_each_kind_of_wrong_citation(text, why, monkeypatch):
    import citations
    monkeypatch.setattr(citations, "documents", lambda: [("example", text)])
    found = [unresolved(c) for c in citations.find_claims()]
    assert any(w and why in w for w in found), found


@pytest.mark.parametrize("text", [
    "vLLM's `KVCacheManager.allocate_slots` in `vllm/v1/core/kv_cache_manager.py`",
    "vLLM's `--max-num-batched-tokens`, `VLLM_USE_V2_MODEL_RUNNER`, `vllm:num_preemptions_total`",
    "v0.6.6's `csrc/attention/attention_kernels.cuh` and its `--block-size-old` flag",
    "0.33.0 has no `VLLM_ATTENTION_BACKEND` variable",
    'vLLM logs "Model loading took %s GiB memory and %.6f seconds"',
])
def test_the_checker_passes_citations_that_hold(text, monkeypatch):
    import citations
    monkeypatch.setattr(citations, "documents", lambda: [("example", text)])
    found = citations.find_claims()
    assert found and not [unresolved(c) for c in found if unresolved(c)]
