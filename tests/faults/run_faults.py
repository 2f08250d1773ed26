"""Plants each fault of `tests/faults/table.py` in a temporary copy of the repository, one at a
time, runs the tests that should catch it and prints fault -> catching test.

    python tests/faults/run_faults.py [--only SUBSTRING ...] [--jobs N] [--keep]

Exits 1 if a fault survives its tests, if a planted fault breaks collection instead of
failing a test, or if a fault's `old` snippet does not occur exactly once in its file.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from jaxsim.storage.paths import SENTEVAL_ROOT  # noqa: E402
from tests.faults.table import FAULTS, Fault  # noqa: E402

TIMEOUT_S = 900


def copy_repository(dest: Path) -> Path:
    """The working tree's tracked and untracked-but-not-ignored files, copied to `dest`."""
    listed = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others',
                             '--exclude-standard'], cwd=REPO, capture_output=True, check=True)
    for rel in filter(None, listed.stdout.decode().split('\0')):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def snippet_problems(root: Path) -> list[str]:
    """Faults whose `old` text does not occur exactly once in its file (under `root`)."""
    problems = []
    for f in FAULTS:
        path = root / f.file
        count = path.read_text(encoding='utf-8').count(f.old) if path.is_file() else -1
        if count != 1:
            where = 'file missing' if count < 0 else f'occurs {count} times'
            problems.append(f'{f.name}: {f.file}: the snippet {where}: {f.old!r}')
    return problems


def run_fault(root: Path, fault: Fault) -> tuple[str, str, float]:
    """(outcome, detail, seconds): outcome 'caught', 'SURVIVED' or 'BROKEN'."""
    path = root / fault.file
    clean = path.read_text(encoding='utf-8')
    path.write_text(clean.replace(fault.old, fault.new, 1), encoding='utf-8')
    # The copies live in a temporary folder, without the shared data beside them.
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS='cpu',
               JAXSIM_SENTEVAL=str(SENTEVAL_ROOT))
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, '-m', 'pytest', '-x', '-q', '-rf',
                               '-p', 'no:cacheprovider', *fault.tests], cwd=root, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 'BROKEN', f'tests ran over {TIMEOUT_S} s', time.monotonic() - start
    finally:
        path.write_text(clean, encoding='utf-8')
    seconds = time.monotonic() - start
    failed = re.findall(r'^FAILED (\S+)', proc.stdout, re.M)
    if proc.returncode == 1 and failed:
        return 'caught', failed[0], seconds
    if proc.returncode == 0:
        return 'SURVIVED', 'all tests passed', seconds
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ['']
    return 'BROKEN', f'pytest exit {proc.returncode}: {tail[0][:120]}', seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--only', action='append', default=None,
                        help='run the faults whose name contains this (repeatable)')
    parser.add_argument('--jobs', type=int, default=min(2, os.cpu_count() or 1),
                        help='faults run at once, each in its own copy (default: 2 or the '
                             'number of CPUs if fewer)')
    parser.add_argument('--keep', action='store_true', help='keep the temporary copies')
    args = parser.parse_args(argv)
    faults = [f for f in FAULTS if args.only is None or any(o in f.name for o in args.only)]
    if not faults:
        print(f'error: no fault name contains any of {args.only}')
        return 2
    workdir = Path(tempfile.mkdtemp(prefix='jaxsim-faults-'))
    try:
        jobs = max(1, min(args.jobs, len(faults)))
        roots = [copy_repository(workdir / f'repo{i}') for i in range(jobs)]
        root = roots[0]
        problems = snippet_problems(root)
        for p in problems:
            print(f'error: {p}')
        check = subprocess.run([sys.executable, '-c', 'import jaxsim; print(jaxsim.__file__)'],
                               cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                               capture_output=True, text=True)
        if not check.stdout.strip().startswith(str(root)):
            print(f'error: the copy does not import its own jaxsim: {check.stdout.strip()}')
            return 1
        if problems:
            return 1
        print(f'{len(faults)} faults, {jobs} at a time, copies under {workdir}', flush=True)
        free: queue.Queue = queue.Queue()
        for r in roots:
            free.put(r)

        def one(fault):  # each fault takes a copy no other fault is using
            copy = free.get()
            try:
                return run_fault(copy, fault)
            finally:
                free.put(copy)

        start, results = time.monotonic(), {}
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(one, f): f for f in faults}
            for future in concurrent.futures.as_completed(futures):
                fault = futures[future]
                outcome, detail, seconds = results[fault.name] = future.result()
                print(f'[{len(results):2d}/{len(faults)}] {outcome:8s} {seconds:6.1f} s  '
                      f'{fault.name} -> {detail}', flush=True)
        rows = [(f, *results[f.name][:2]) for f in faults]
        width = max(len(f.name) for f, _, _ in rows)
        print(f'\n{"fault":{width}s}  {"file":28s}  result    caught by')
        for fault, outcome, detail in rows:
            print(f'{fault.name:{width}s}  {fault.file:28s}  {outcome:8s}  {detail}')
        bad = [f.name for f, outcome, _ in rows if outcome != 'caught']
        print(f'\n{len(rows) - len(bad)} of {len(rows)} faults caught in '
              f'{time.monotonic() - start:.0f} s' + (f'; not caught: {", ".join(bad)}' if bad
                                                      else ''))
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f'kept {workdir}')
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
