"""vLLM's code beside kvlab's (kvlab.exercises.beside_vllm), without vLLM: each cell says how to get it and moves on.

The path with vLLM installed is tested by ``tests/vllm/test_beside_vllm.py`` (``make test-vllm``); here a
fake installation in a temporary folder stands in for it, and nothing imports vLLM.
"""

import inspect
import sys
import textwrap
from pathlib import Path

import pytest

import kvlab.exercises.beside_vllm as side
from kvlab.core.block_pool import BlockPool
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.exercises.plain import free_queue_order

FREE_BLOCKS = "vllm/v1/core/block_pool.py:BlockPool.free_blocks"

FAKE_BLOCK_POOL = '''
import functools


class BlockPool:
    """A stand-in for vLLM's file."""

    @functools.lru_cache  # a decorator, which inspect.getsource keeps
    def free_blocks(self, ordered_blocks):
        return "vLLM's body"

    def other(self):
        pass
'''


def _fake_vllm(root: Path, version: str = "0.33.0") -> Path:
    """A .venv-vllm holding a vllm package of one file, and a python to run it with."""
    package = root / "lib" / "python3.11" / "site-packages" / "vllm"
    (package / "v1" / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (package / "v1" / "core" / "block_pool.py").write_text(FAKE_BLOCK_POOL)
    (root / "bin").mkdir()
    (root / "bin" / "python").symlink_to(sys.executable)
    return root


def test_without_vllm_kvlab_s_code_is_shown_alone_with_how_to_get_vllm(tmp_path):
    assert side.find_vllm(tmp_path) is None                         # (vLLM is not importable in .venv either)
    shown = side.beside(BlockPool._free_blocks, FREE_BLOCKS, venv=tmp_path)
    assert shown.vllm_source is None and "make test-vllm" in shown.note and "vllm==0.33.0" in shown.note
    assert "def _free_blocks" in repr(shown) and "make test-vllm" in repr(shown)
    page = shown._repr_html_()
    assert "kvlab.core.block_pool.BlockPool._free_blocks" in page and "<code>make test-vllm</code>" in page
    with pytest.raises(KvlabValueError, match="make test-vllm"):
        side.vllm_source(FREE_BLOCKS, side.find_vllm(tmp_path))


def test_without_vllm_an_answer_is_not_run_and_the_cell_says_why(tmp_path):
    result = side.against_vllm("03.free_queue_order", free_queue_order, venv=tmp_path)
    assert result.status == "not attempted" and "make test-vllm" in result.message

    def stub(queue, table, cached):
        raise NotImplementedError("your code here")

    assert "write your answer above first" in side.against_vllm("03.free_queue_order", stub, venv=tmp_path).message
    with pytest.raises(UnknownNameError, match="03.free_queue_order"):
        side.against_vllm("03.cow_append", stub)


def test_the_source_read_from_the_file_is_what_inspect_getsource_gives():
    import kvlab.core.block_pool as module

    for name in ("BlockPool._free_blocks", "BlockPool.get_new_blocks", "BlockPool"):
        target = module
        for part in name.split("."):
            target = getattr(target, part)
        assert side.source_in_file(Path(module.__file__), name) == textwrap.dedent(inspect.getsource(target))
    with pytest.raises(UnknownNameError, match="get_new_blocks"):
        side.source_in_file(Path(module.__file__), "BlockPool.no_such_method")


def test_an_installed_vllm_is_found_without_importing_it_and_shown_beside_kvlab(tmp_path):
    venv = _fake_vllm(tmp_path / ".venv-vllm")
    install = side.find_vllm(venv)
    assert install.version == "0.33.0" and install.python == venv / "bin" / "python"
    shown = side.beside(BlockPool._free_blocks, FREE_BLOCKS, venv=venv)
    assert shown.vllm_source.startswith("@functools.lru_cache") and "vLLM's body" in shown.vllm_source
    assert "def other" not in shown.vllm_source and shown.note == ""
    page = shown._repr_html_()
    assert page.count("<pre") == 2 and "grid-template-columns" in page and "vllm/v1/core/block_pool.py" in page
    assert "vllm" not in sys.modules


def test_another_vllm_release_is_shown_with_a_warning(tmp_path):
    shown = side.beside(BlockPool._free_blocks, FREE_BLOCKS, venv=_fake_vllm(tmp_path / "v", "0.34.1"))
    assert shown.vllm_source and "0.34.1" in shown.note and "0.33.0" in shown.note


def test_names_are_checked_at_the_door(tmp_path):
    install = side.find_vllm(_fake_vllm(tmp_path / "v"))
    with pytest.raises(KvlabValueError, match="vllm/<file>.py"):
        side.vllm_source("BlockPool.free_blocks", install)
    with pytest.raises(KvlabValueError, match="kvlab function"):
        side.beside(len, FREE_BLOCKS)


def test_an_answer_is_compared_case_by_case_with_the_vllm_built_reference(monkeypatch):
    # The comparison itself, with kvlab's own answer standing in for vLLM's reference (no vLLM here).
    monkeypatch.setitem(side.REFERENCES_ON_VLLM, "03.free_queue_order", (free_queue_order, FREE_BLOCKS))
    monkeypatch.setattr(side, "find_vllm", lambda venv=None: side.VllmInstall(Path("vllm"), "0.33.0", None))
    passed = side.against_vllm("03.free_queue_order", free_queue_order, seed=3)
    assert passed.passed and "vLLM 0.33.0's own BlockPool.free_blocks" in passed.message

    def every_block_to_the_tail(queue, table, cached):
        return list(queue) + list(reversed(table))

    failed = side.against_vllm("03.free_queue_order", every_block_to_the_tail, seed=3)
    assert failed.status == "fail" and "case 1" in failed.message and "[2, 3, 4, 5, 1, 0]" in failed.message
