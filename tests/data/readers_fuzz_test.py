"""Seeded fuzzing of the readers: corrupted files give a file:line JaxsimError or a documented
recovery (a blank line skipped, an empty gold score dropping its pair), never a traceback.

Corruptions: truncation at a random byte, a field separator added or removed on a random line,
an invalid UTF-8 byte, a NUL byte, a line over MAX_LINE_CHARS. Where the corruption decides the
line (invalid UTF-8, NUL, an overlong line), the error must name exactly that line.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from jaxsim.data import readers, senteval
from jaxsim.errors import JaxsimError
from tests.data.tiny_senteval import write_tiny_senteval

CASES_PER_KIND = 8
KINDS = ('truncate', 'field', 'utf8', 'nul', 'huge')


def _line_of(data: bytes, pos: int) -> int:
    return data.count(b'\n', 0, pos) + 1


def corrupt(data: bytes, kind: str, sep: bytes, rng: np.random.Generator):
    """Returns (corrupted bytes, the line the error must name or None)."""
    pos = int(rng.integers(0, len(data) + 1))
    if kind == 'truncate':
        return data[:pos], None
    if kind == 'field':
        lines = data.split(b'\n')
        i = int(rng.integers(0, len(lines)))
        if sep in lines[i] and rng.random() < 0.5:
            lines[i] = lines[i].replace(sep, b' ', 1)
        else:
            cut = int(rng.integers(0, len(lines[i]) + 1))
            lines[i] = lines[i][:cut] + sep + lines[i][cut:]
        return b'\n'.join(lines), None
    bad = {'utf8': bytes([int(rng.choice([0x80, 0xc3, 0xff, 0xfe]))]), 'nul': b'\x00',
           'huge': b'y' * (readers.MAX_LINE_CHARS + 1)}[kind]
    return data[:pos] + bad + data[pos:], _line_of(data, pos)


def items(result) -> list:
    """A loader's result as a list of hashable records (an STS task: its scored pairs)."""
    if isinstance(result, senteval.StsTask):
        return [(name, a, b, float(g)) for name, pairs in result.subsets.items()
                for a, b, g in zip(pairs.sent1, pairs.sent2, pairs.gold)]
    return [tuple(x) if isinstance(x, (list, tuple)) else x for x in result]


def check(load, path, names, expect_line, original, kind, expect=None):
    """Runs `load`; an error must be a JaxsimError naming a path in `names` (and the line).

    A recovered parse must be the documented one: `expect()` when given (an independent
    parse of the corrupted file), and in any case the clean parse with only the records of
    the damaged line changed: at most two records that the clean file does not have (a line
    split in two) and at most two of its records gone (two lines joined; a truncation keeps
    the records before the cut, in order).
    """
    try:
        result = load()
    except JaxsimError as e:
        msg = str(e)
        assert any(msg.startswith(f'{n}:') or msg.startswith(f'{n} ') or f'{n}:' in msg
                   for n in names), msg
        if expect_line is not None:
            assert re.search(rf'{re.escape(str(path))}:{expect_line}: ', msg), (expect_line, msg)
        return 'error'
    assert expect_line is None, f'{path}: corruption at line {expect_line} was not detected'
    got = items(result)
    if expect is not None:
        assert got == expect(), (path, kind)
    new = [x for x in got if x not in set(original)]
    assert len(new) <= 2, (path, kind, new[:3])
    if kind == 'truncate':  # what survives is the records before the cut, in order
        kept = [x for x in got if x in set(original)]
        assert kept == original[:len(kept)], (path, kind)
    else:
        assert len([x for x in original if x not in set(got)]) <= 2, (path, kind)
    return 'recovered'


def _fuzz(seed: int, files, load, sep: bytes, names=None, expect=None):
    rng = np.random.default_rng(seed)
    original = items(load())
    outcomes = []
    for kind in KINDS:
        for _ in range(CASES_PER_KIND):
            path = files[int(rng.integers(0, len(files)))]
            clean = path.read_bytes()
            data, line = corrupt(clean, kind, sep, rng)
            path.write_bytes(data)
            try:
                outcomes.append(check(load, path, names or [str(path)], line, original, kind,
                                      expect and (lambda: expect(data))))
            finally:
                path.write_bytes(clean)
    return outcomes


def test_fuzz_sentence_file(tmp_path):
    path = tmp_path / 'sentences.txt'
    path.write_text('a man plays a guitar .\n\ncafé au lait\n  two  spaces \nthe end\n')
    # Independently: the non-blank lines, stripped.
    expect = lambda data: [x.strip() for x in data.decode().split('\n') if x.strip()]  # noqa: E731
    out = _fuzz(0, [path], lambda: readers.read_sentences(path), b'\n', expect=expect)
    assert 'error' in out and 'recovered' in out


@pytest.mark.parametrize('task', ['sts12', 'stsb', 'sickr'])
def test_fuzz_senteval_sts_files(tmp_path, task):
    root = write_tiny_senteval(tmp_path, sick_test=True)
    folder = {'sts12': 'STS/STS12-en-test', 'stsb': 'STS/STSBenchmark', 'sickr': 'SICK'}[task]
    pattern = {'sts12': 'STS.*.MSR*.txt', 'stsb': 'sts-test.csv',
               'sickr': 'SICK_test_annotated.txt'}[task]
    files = sorted((root / folder).glob(pattern))
    out = _fuzz(1, files, lambda: senteval.load_sts_task(task, root), b'\t',
                names=[str(f) for f in files])
    assert 'error' in out


def test_fuzz_nli_csv(tmp_path):
    path = readers.write_nli_csv([('a man sleeps', 'a person rests', 'a man runs'),
                                  ('x, "quoted"', 'y', 'z'), ('p', 'q', 'r')], tmp_path / 'n.csv')
    out = _fuzz(2, [path], lambda: readers.read_nli_csv(path), b',')
    assert 'error' in out


def test_fuzz_snli(tmp_path):
    (tmp_path / 's1.dev').write_text('p1\np1\np1\np2\np2\n')
    (tmp_path / 's2.dev').write_text('e1\nc1\nn1\ne2\nc2\n')
    (tmp_path / 'labels.dev').write_text(
        'entailment\ncontradiction\nneutral\nentailment\ncontradiction\n')
    files = [tmp_path / f'{n}.dev' for n in ('s1', 's2', 'labels')]
    out = _fuzz(3, files, lambda: readers.build_snli_triplets(tmp_path, ['dev']), b'\n',
                names=[str(f) for f in files] + [str(tmp_path)])
    assert 'error' in out
