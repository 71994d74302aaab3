"""``make test-mutants``: apply each mutant of the catalogue to a scratch copy of kvlab and run the suite on it.

How one mutant is run (``run_mutant``):

1. A scratch folder holds a copy of the package as it is installed: ``kvlab/`` and ``kernels/`` as
   ``kvlab/kernels/``, with ``data/`` linked beside it (``kvlab.data`` finds it there), plus
   ``mutation_site/``'s ``sitecustomize.py``. The folder goes first on ``PYTHONPATH``, before the
   editable install's finder (which setuptools appends to ``sys.meta_path``, after the path finder),
   and pytest runs from inside it, so no process meets the worktree's ``kvlab/`` first. Every process
   (pytest, the notebooks' kernels, subprocesses of tests) logs where it imported ``kvlab`` and
   ``kvlab.kernels`` from; one line pointing elsewhere stops the suite. The worktree is never written.
2. The mutant's one replacement is written into the scratch copy (a stale anchor stops the suite).
3. The notebooks run under nbval, the mutant's hinted notebooks first, stopping at the first failing
   cell: a failure there kills the mutant *by the notebooks*. Only if every notebook passes do the
   tests run (hinted files first, the engine tests last), again stopping at the first failure.
   Both scores come from this one pass: killed by the notebooks alone, and by the whole suite.
4. The scratch copy is checked to differ from the snapshot by that one change only, then restored.

At the end every test that killed a mutant, and every notebook that did (whole), is run once on the
unmutated copy, where the killer must pass (a kill by a test or cell that fails anyway would be no
kill); ``--baseline`` first runs everything there.
Results go to ``data/measurements/mutants.json`` with the machine, the load and the date.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation_catalogue import ROOT, Mutant, all_mutants, apply  # noqa: E402

SITE_DIR = Path(__file__).resolve().parent / "mutation_site"
#: Notebooks in the order they run when not hinted: quickest first (measured on 2 cores).
NOTEBOOK_ORDER = ("01", "04", "03", "02", "10", "08", "07", "05", "06", "09")
#: Tests that hold the real installation to its layout and cannot pass on a scratch copy.
SCRATCH_DESELECT = ("tests/test_packaging.py::test_kernels_folder_is_installed_as_kvlab_kernels_and_not_as_kernels",)
TEST_ARGS = ("-m", "not ui", "--ignore=tests/vllm", "--ignore=tests/test_mutants.py",
             *(f"--deselect={d}" for d in SCRATCH_DESELECT))
SLOW_LAST = ("tests/engine/",)


class SuiteError(RuntimeError):
    """The suite cannot give a trustworthy answer (wrong package imported, pytest broke): it stops."""


def package_files(root: Path = ROOT) -> dict[str, bytes]:
    """Every source file of the installed package, by repository path (``kvlab/...``, ``kernels/...``)."""
    files = {}
    for top in ("kvlab", "kernels"):
        for path in sorted((root / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def scratch_path(repo_path: str) -> str:
    """Where a repository file lives in the scratch copy: ``kernels/x.py`` is ``kvlab/kernels/x.py``."""
    return "kvlab/" + repo_path if repo_path.startswith("kernels/") else repo_path


@dataclasses.dataclass
class Phase:
    """One pytest run: ``passed``, ``killed`` (by ``killer``) or ``timeout``."""

    status: str
    seconds: float
    killer: str | None = None
    message: str | None = None


class Scratch:
    """A scratch copy of the package, its environment and its logs."""

    def __init__(self, base: Path, name: str, snapshot: dict[str, bytes], pristine_kernels: Path,
                 seed: int | None = None) -> None:
        self.root = base / name
        self.snapshot = snapshot
        for repo_path, content in snapshot.items():
            target = self.root / scratch_path(repo_path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        (self.root / "data").symlink_to(ROOT / "data")
        for helper in SITE_DIR.glob("*.py"):
            shutil.copy(helper, self.root / helper.name)
        self.pristine_kernels = pristine_kernels
        self.seed = seed
        self.runs = 0
        self.last_junit: Path | None = None

    def env(self, log: Path, label: str, first: tuple[str, ...] = ()) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), *filter(None, [env.get("PYTHONPATH")])])
        env.update(
            PYTHONDONTWRITEBYTECODE="1",                       # no stale .pyc between mutants
            KVLAB_MUTATION_SCRATCH=str(self.root), KVLAB_MUTATION_LOG=str(log),
            KVLAB_KERNEL_SOURCES=str(self.pristine_kernels),   # kernels/mutants.py mutates the unchanged kernels
            HYPOTHESIS_STORAGE_DIRECTORY=str(self.root / ".hypothesis" / label),  # no examples kept between runs
            KVLAB_MUTATION_FIRST=os.pathsep.join(first), KVLAB_MUTATION_LAST=os.pathsep.join(SLOW_LAST),
        )
        if self.seed is not None:                              # sitecustomize seeds random in every process
            env["KVLAB_MUTATION_SEED"] = str(self.seed)
        return env

    def write(self, mutant: Mutant | None) -> None:
        """Put the scratch copy in the state of ``mutant`` (None: unmutated), checking nothing else changed."""
        changed = {} if mutant is None else {mutant.path: apply(mutant, self.snapshot[mutant.path].decode()).encode()}
        for repo_path, content in self.snapshot.items():
            target = self.root / scratch_path(repo_path)
            if target.read_bytes() != content:
                target.write_bytes(content)
        for repo_path, content in changed.items():
            (self.root / scratch_path(repo_path)).write_bytes(content)

    def check_unchanged(self, mutant: Mutant | None) -> None:
        """After a run: the package differs from the snapshot by the mutant's change only."""
        expected = {} if mutant is None else {mutant.path: apply(mutant, self.snapshot[mutant.path].decode()).encode()}
        for repo_path, content in self.snapshot.items():
            if (self.root / scratch_path(repo_path)).read_bytes() != expected.get(repo_path, content):
                raise SuiteError(f"{repo_path} in the scratch copy was changed by the run of {mutant and mutant.name}")

    def pytest(self, args: list[str], label: str, timeout: float, first: tuple[str, ...] = ()) -> Phase:
        """Run pytest on ``args`` inside the scratch copy; the first failure (junit) is the killer."""
        self.runs += 1
        stem = self.root / "logs" / f"{self.runs:03d}-{label}"
        stem.parent.mkdir(exist_ok=True)
        junit, log, out = stem.with_suffix(".xml"), stem.with_suffix(".imports"), stem.with_suffix(".out")
        # -m "not ui": never the browser, not even the rendering item conftest.py adds after a notebook's cells.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvlab_mutation_order",
               f"--rootdir={ROOT}", "-o", "junit_family=xunit1", f"--junitxml={junit}", "-m", "not ui", *args]
        start = time.monotonic()
        with open(out, "wb") as sink:
            proc = subprocess.Popen(cmd, cwd=self.root, env=self.env(log, label, first), stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)            # our own pytest and what it started
                proc.wait()
                rc = None
        seconds = time.monotonic() - start
        _check_imports(log, out)
        if rc is None:
            return Phase("timeout", seconds, f"no result within {timeout:.0f} s")
        if rc == 0:
            return Phase("passed", seconds)
        self.last_junit = junit
        failure = next(iter(_failures(junit)), None) if rc in (1, 2) and junit.exists() else None
        if failure is None:
            raise SuiteError(f"pytest exited {rc} without a failing test ({' '.join(args[:4])} ...); "
                             f"its output ends:\n{out.read_text(errors='replace')[-3000:]}")
        return Phase("killed", seconds, *failure)


def _check_imports(log: Path, out: Path) -> None:
    lines = log.read_text().splitlines() if log.exists() else []
    bad = [line for line in lines if " FAIL " in f" {line} "]
    if bad:
        raise SuiteError("a process imported kvlab from outside the scratch copy:\n" + "\n".join(bad[:5]))
    if not any(" OK kvlab " in f" {line} " for line in lines):
        raise SuiteError(f"no process of the run reported importing kvlab from the scratch copy (see {out})")


def _failures(junit: Path) -> Iterator[tuple[str, str]]:
    """The node id and message line of every failed (or erroring) test case of a junit report, in run order."""
    for case in ET.parse(junit).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                file, cls, name = case.get("file") or "", case.get("classname") or "", case.get("name") or ""
                module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
                inner = cls[len(module) + 1:] if module and cls.startswith(module + ".") else ""
                node = "::".join(p for p in (file or cls, inner, name) if p)
                yield node, _error_line(child)
                break


def _error_line(child: ET.Element) -> str:
    """The exception line of a failure (``AssertionError: ...``), else its message: what the table shows."""
    text = re.sub(r"\x1b\[[0-9;]*m|#x1B\[[0-9;]*m", "", child.text or "")
    errors = [line.strip() for line in text.splitlines() if re.match(r"\s*(E\s+)?[\w.]*(Error|Exception)\b", line)]
    message = (child.get("message") or "").strip().splitlines()
    line = errors[-1] if errors else message[0] if message else child.tag
    arrows = [m.group(1) for m in re.finditer(r"^-{3,}>\s*[0-9]*\s*(.*)$", text, re.M)]   # nbval: the failing line
    if arrows:
        line = f"{line.rstrip(': ')} at {arrows[-1].strip()}"
    return line[:200]


def notebooks_in_order(hints: tuple[str, ...]) -> list[str]:
    """The notebook paths, the hinted numbers first, then the rest quickest first."""
    found = {p.name[:2]: str(p) for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))}
    order = [n for n in (*hints, *NOTEBOOK_ORDER) if n in found]
    order += sorted(set(found) - set(order))
    return [found[n] for n in dict.fromkeys(order)]


@dataclasses.dataclass
class Result:
    mutant: Mutant
    notebooks: Phase
    tests: Phase | None
    confirmed: bool | None = None     # the killing test or notebook cell passes on the unmutated copy

    @property
    def killed(self) -> bool:
        return self.notebooks.status != "passed" or (self.tests is not None and self.tests.status != "passed")

    @property
    def by_notebooks(self) -> bool:
        return self.notebooks.status != "passed"

    @property
    def deciding(self) -> Phase:
        return self.notebooks if self.by_notebooks or self.tests is None else self.tests

    @property
    def seconds(self) -> float:
        return self.notebooks.seconds + (self.tests.seconds if self.tests else 0.0)

    def row(self) -> dict:
        phase = self.deciding
        return {"mutant": self.mutant.name, "layer": self.mutant.layer, "file": self.mutant.path,
                "bug": self.mutant.bug, "killed": self.killed, "by_notebooks": self.by_notebooks,
                "status": phase.status, "killed_by": phase.killer if self.killed else None,
                "message": phase.message if self.killed else None, "confirmed": self.confirmed,
                "seconds": round(self.seconds, 1), "notebook_seconds": round(self.notebooks.seconds, 1),
                "test_seconds": None if self.tests is None else round(self.tests.seconds, 1)}


def run_mutant(scratch: Scratch, mutant: Mutant, timeout: float) -> Result:
    """Notebooks first (hinted first), then the tests only if no notebook failed; the scratch copy restored."""
    scratch.write(mutant)
    try:
        nb = scratch.pytest(["-x", *notebooks_in_order(mutant.notebooks)], f"{mutant.name}-nb", timeout)
        tests = None
        if nb.status == "passed":
            tests = scratch.pytest(["-x", *TEST_ARGS, str(ROOT / "tests")], f"{mutant.name}-tests", timeout,
                                   first=mutant.tests)
        scratch.check_unchanged(mutant)
    finally:
        scratch.write(None)
    return Result(mutant, nb, tests)


def confirm_killers(scratches: list[Scratch], results: list[Result], timeout: float) -> None:
    """Run each killing test, and each killing notebook whole, once on the unmutated copy: the killer must pass there.

    The tests and the notebooks run at the same time when there are two scratch copies."""
    killers: dict[str, list[Result]] = {}
    for r in results:
        if r.killed and r.deciding.status == "killed" and r.deciding.killer:
            killers.setdefault(r.deciding.killer, []).append(r)
    notebooks = sorted({k.split("::")[0] for k in killers if ".ipynb" in k.split("::")[0]})
    tests = [k for k in killers if "::" in k and ".ipynb" not in k.split("::")[0]]
    runs = []      # (pytest arguments, label, the killers it confirms)
    if tests:
        runs.append(([*TEST_ARGS, *(f"{ROOT}/{node}" for node in tests)], "confirm-tests", tests))
    if notebooks:      # whole notebooks, not stopping at a failure: every killing cell gets its verdict
        runs.append(([f"{ROOT}/{nb}" for nb in notebooks], "confirm-notebooks",
                     [k for k in killers if k.split("::")[0] in notebooks]))

    def confirm(scratch: Scratch, args: list[str], label: str, nodes: list[str]) -> None:
        scratch.write(None)
        phase = scratch.pytest(args, label, timeout)
        failing = {node for node, _ in _failures(scratch.last_junit)} if phase.status == "killed" else set()
        for node in nodes:
            for result in killers[node]:
                result.confirmed = phase.status != "timeout" and node not in failing

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(scratches)) as pool:
        for future in [pool.submit(confirm, scratches[i % len(scratches)], *run) for i, run in enumerate(runs)]:
            future.result()


def print_table(results: list[Result]) -> None:
    print(f"\n{'mutant':<27} {'layer':<9} {'result':<9} {'by':<90} {'s':>6}  confirmed")
    for r in results:
        row = r.row()
        result = ("killed" if r.killed else "SURVIVED") if r.deciding.status != "timeout" else "timeout"
        confirmed = {None: "-", True: "yes", False: "NO"}[r.confirmed]
        print(f"{row['mutant']:<27} {row['layer']:<9} {result:<9} {(row['killed_by'] or '-')[:90]:<90} "
              f"{row['seconds']:>6.1f}  {confirmed}")


def scores(results: list[Result]) -> dict:
    n = len(results)
    suite, nbs = sum(r.killed for r in results), sum(r.by_notebooks for r in results)
    return {"suite": {"killed": suite, "total": n, "percent": round(100 * suite / n, 1) if n else None},
            "notebooks": {"killed": nbs, "total": n, "percent": round(100 * nbs / n, 1) if n else None}}


def save(results: list[Result], wall: float, loads: list[tuple[float, float, float]], jobs: int,
         baseline: dict | None, not_run: list[str], seed: int | None) -> Path:
    sys.path.insert(0, str(ROOT))
    from kvlab.machine import save_measurement

    method = ("scripts/mutation.py (make test-mutants): each mutant applied alone to a scratch copy of kvlab "
              "imported first on PYTHONPATH (checked in every process); nbval over notebooks/ first, hinted "
              "notebooks first, stopping at the first failing cell; if no notebook failed, pytest over tests/ "
              "(-m 'not ui', hinted files first, tests/engine last), stopping at the first failure; each killing "
              "test and notebook then rerun on the unmutated copy, where the killer must pass; Python's random "
              "seeded alike in every process (python_random_seed), so a kill only some draws give shows there too. "
              f"Seconds are wall time per mutant, {jobs} mutant(s) at a time, on a shared machine (load below).")
    payload = {"complete": not not_run, "not_run": not_run,   # --stop-after: the mutants never started
               "scores": scores(results), "wall_seconds": round(wall, 1), "jobs": jobs,
               "python_random_seed": seed,
               "load_average_1min": {"start": loads[0][0], "end": loads[-1][0],
                                     "max": max(load[0] for load in loads)},
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(time.time() - wall)),
               "baseline": baseline, "mutants": [r.row() for r in results]}
    return save_measurement("mutants", payload, method)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only (results not saved)")
    parser.add_argument("--list", action="store_true", help="list the mutants and check their anchors; run nothing")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="mutants run at the same time, each in its own copy (default: 2, or 1 on one core)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one pytest run may take")
    parser.add_argument("--baseline", action="store_true", help="first run everything on the unmutated copy")
    parser.add_argument("--stop-after", type=float, metavar="SECONDS",
                        help="start no mutant after this many seconds; those run are saved, the rest listed as not run")
    parser.add_argument("--seed", type=int, default=20261201,
                        help="seed of Python's random in every process (fresh_seed's draws repeat; -1: unseeded)")
    parser.add_argument("--no-save", action="store_true", help="do not write data/measurements/mutants.json")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies and their logs")
    args = parser.parse_args(argv)

    catalogue = all_mutants()
    snapshot = package_files()
    for mutant in catalogue:                       # every anchor checked before anything runs
        apply(mutant, snapshot[mutant.path].decode())
    if args.list:
        for m in catalogue:
            print(f"{m.name:<27} {m.layer:<9} {m.path:<40} {m.bug}")
        print(f"{len(catalogue)} mutants, every anchor found exactly once")
        return 0
    chosen = catalogue
    if args.only:
        known = {m.name: m for m in catalogue}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            parser.error(f"unknown mutant(s) {unknown}; --list shows the {len(known)} known")
        chosen = [known[n] for n in args.only]

    base = Path(tempfile.mkdtemp(prefix="kvlab-mutants-"))
    try:  # the scratch copies go, however the run ends (a SuiteError or Ctrl-C included)
        pristine = base / "pristine-kernels"
        for repo_path, content in snapshot.items():
            if repo_path.startswith("kernels/"):
                (pristine / repo_path[len("kernels/"):]).parent.mkdir(parents=True, exist_ok=True)
                (pristine / repo_path[len("kernels/"):]).write_bytes(content)
        workers: queue.Queue[Scratch] = queue.Queue()
        for i in range(max(1, args.jobs)):
            workers.put(Scratch(base, f"copy-{i}", snapshot, pristine, None if args.seed == -1 else args.seed))
        print(f"{len(chosen)} mutants, scratch copies in {base}, {args.jobs} at a time")
        start, loads, results, lock = time.monotonic(), [os.getloadavg()], {}, threading.Lock()
        baseline = run_baseline(workers.queue[0], args.timeout) if args.baseline else None

        def one(mutant: Mutant) -> None:
            scratch = workers.get()
            if args.stop_after is not None and time.monotonic() - start > args.stop_after:
                workers.put(scratch)
                return
            try:
                result = run_mutant(scratch, mutant, args.timeout)
            finally:
                workers.put(scratch)
            with lock:
                results[mutant.name] = result
                loads.append(os.getloadavg())
                verdict = "notebooks" if result.by_notebooks else "tests" if result.killed else "SURVIVED"
                print(f"[{len(results):2d}/{len(chosen)}] {mutant.name:<27} {verdict:<9} "
                      f"{result.deciding.killer or ''}  ({result.seconds:.0f} s)", flush=True)
                if result.killed:
                    print(f"      {result.deciding.message}", flush=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for future in [pool.submit(one, m) for m in chosen]:
                future.result()                        # a SuiteError stops the run here, loudly
        ordered = [results[m.name] for m in chosen if m.name in results]
        not_run = [m.name for m in chosen if m.name not in results]
        confirm_killers(list(workers.queue), ordered, args.timeout)
        wall = time.monotonic() - start
        print_table(ordered)
        s = scores(ordered)
        if not_run:
            print(f"\n--stop-after: {len(not_run)} mutant(s) not run: {' '.join(not_run)}")
        print(f"\nkilled by the whole suite: {s['suite']['killed']}/{s['suite']['total']} ({s['suite']['percent']} %)")
        print(f"killed by the notebooks alone: {s['notebooks']['killed']}/{s['notebooks']['total']} "
              f"({s['notebooks']['percent']} %)")
        print(f"wall time {wall / 60:.1f} min, load average (1 min) {loads[0][0]:.1f} at start, "
              f"{max(load[0] for load in loads):.1f} at most, {os.cpu_count()} cores")
        if not args.only and not args.no_save:
            seed = None if args.seed == -1 else args.seed
            print(f"saved to {save(ordered, wall, loads, args.jobs, baseline, not_run, seed)}")
        unconfirmed = [r.mutant.name for r in ordered if r.confirmed is False]
        if unconfirmed:
            print(f"UNCONFIRMED kills (the killing test or cell fails on the unmutated copy too): {unconfirmed}")
        return 1 if unconfirmed or not_run or not all(r.killed for r in ordered) else 0
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def run_baseline(scratch: Scratch, timeout: float) -> dict:
    """Every notebook and test on the unmutated copy: all must pass, or no kill could be trusted."""
    scratch.write(None)
    out = {}
    for label, args in (("notebooks", notebooks_in_order(())), ("tests", [*TEST_ARGS, str(ROOT / "tests")])):
        phase = scratch.pytest(args, f"baseline-{label}", timeout * 2)
        print(f"baseline {label}: {phase.status} in {phase.seconds:.0f} s {phase.killer or ''}", flush=True)
        if phase.status != "passed":
            raise SuiteError(f"the unmutated scratch copy fails its {label}: {phase.killer}: {phase.message}")
        out[label + "_seconds"] = round(phase.seconds, 1)
    return out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SuiteError as exc:
        print(f"\nmutation suite stopped: {exc}", file=sys.stderr)
        sys.exit(2)
