"""Line-offset indexes and the file sources: the same records as the whole-file readers, built
once and reused while the file is unchanged, rebuilt when it changes, bad lines named
file:line."""
import hashlib
import os
import re
from pathlib import Path

import numpy as np
import pytest

from jaxsim.data import index, readers, sources
from jaxsim.data.readers import DataError
from jaxsim.storage import store
from jaxsim.storage.paths import SENTEVAL_ROOT


@pytest.fixture(autouse=True)
def index_cache(tmp_path, monkeypatch):
    """The default placement (beside the file, else the home cache), with a private home."""
    monkeypatch.delenv('JAXSIM_INDEX_DIR', raising=False)
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))


def _random_text(rng, lines: int) -> bytes:
    words = ['a', 'dog', 'Ünïcode', '漢字', 'x\u2028y', '\u00a0', '\u2003', ' ', '\t', 'end.',
             '\x1f', '"q"', ',']
    out = []
    for _ in range(lines):
        n = int(rng.integers(0, 6))
        line = ' '.join(rng.choice(words, n)) if n else ''
        out.append(line + ('\r' if rng.random() < 0.2 else ''))
    return '\n'.join(out).encode()


def test_text_source_reads_what_read_sentences_reads(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / 'corpus.txt'
    path.write_bytes(b'\xef\xbb\xbf' + _random_text(rng, 3000))
    src = sources.TextSource(path)
    assert [src[i][0] for i in range(len(src))] == readers.read_sentences(path)
    assert src.index.sha256 == 'sha256:' + hashlib.sha256(path.read_bytes()).hexdigest()
    assert src.index.lines == 3000


@pytest.mark.parametrize('chunk', [7, 64, 1000])
def test_small_chunks_give_the_same_index(tmp_path, monkeypatch, chunk):
    # Chunk edges fall inside lines and multi-byte characters; the records must not move.
    path = tmp_path / 'corpus.txt'
    path.write_bytes(_random_text(np.random.default_rng(1), 400) + b'\n')
    whole = index.load_or_build(path, 'text')
    (tmp_path / 'corpus.txt.text-index.json').unlink()
    monkeypatch.setattr(index, 'CHUNK_BYTES', chunk)
    parts = index.load_or_build(path, 'text')
    np.testing.assert_array_equal(np.asarray(parts.offsets), np.asarray(whole.offsets))
    assert (parts.sha256, parts.lines) == (whole.sha256, whole.lines)


def test_index_is_reused_while_unchanged_and_rebuilt_when_changed(tmp_path, monkeypatch):
    path = tmp_path / 'corpus.txt'
    path.write_text('one\ntwo\nthree\n')
    first = sources.TextSource(path)
    assert first.build_s > 0 and (tmp_path / 'corpus.txt.text-index.npy').exists()
    real_scan = index._scan
    monkeypatch.setattr(index, '_scan', lambda *a: pytest.fail('rebuilt an unchanged index'))
    again = sources.TextSource(path)
    assert again.build_s == 0.0 and again.fingerprint() == first.fingerprint()
    # Same size, same modification time, different content: the edge hash notices.
    st = path.stat()
    path.write_text('one\ntwo\nthreE\n')
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(index, '_scan', real_scan)
    changed = sources.TextSource(path)
    assert changed.build_s > 0 and changed[2] == ('threE',)
    assert changed.fingerprint() != first.fingerprint()
    # Appending changes size and mtime.
    with path.open('a') as f:
        f.write('four\n')
    assert len(sources.TextSource(path)) == 4


def test_an_explicit_index_folder_keeps_data_folders_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv('JAXSIM_INDEX_DIR', str(tmp_path / 'index-cache'))
    path = tmp_path / 'data' / 'corpus.txt'
    path.parent.mkdir()
    path.write_text('a\nb\n')
    assert len(sources.TextSource(path)) == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ['corpus.txt']
    assert len(list((tmp_path / 'index-cache').glob('*-corpus.txt.text-index.npy'))) == 1


def test_without_an_index_folder_the_index_lives_beside_a_writable_corpus(tmp_path):
    path = tmp_path / 'data' / 'corpus.txt'
    path.parent.mkdir()
    path.write_text('a\nb\n')
    assert len(sources.TextSource(path)) == 2
    assert (path.parent / 'corpus.txt.text-index.npy').is_file()
    assert not (tmp_path / 'home').exists()


def test_unwritable_corpus_folder_caches_the_index_elsewhere(tmp_path, monkeypatch):
    path = tmp_path / 'data' / 'corpus.txt'
    path.parent.mkdir()
    path.write_text('a\nb\n')
    real = store.open_atomic

    def refuse_beside(target, *args, **kwargs):
        if Path(target).parent == path.parent:
            raise PermissionError(13, 'Permission denied')
        return real(target, *args, **kwargs)

    monkeypatch.setattr(store, 'open_atomic', refuse_beside)
    src = sources.TextSource(path)
    assert [src[i] for i in range(2)] == [('a',), ('b',)]
    assert sorted(p.name for p in path.parent.iterdir()) == ['corpus.txt']
    cache = tmp_path / 'home' / '.cache' / 'jaxsim' / 'index'
    assert len(list(cache.glob('*-corpus.txt.text-index.npy'))) == 1
    assert sources.TextSource(path).build_s == 0.0  # found in the cache folder


@pytest.mark.parametrize('content, message', [
    (b'ok\nfine\n\xff bad\n', r'corpus.txt:3: not valid UTF-8 \(invalid start byte at byte 8\)'),
    (b'ok\nbin\x00ary\n', 'corpus.txt:2: NUL byte'),
    (b'ok\n' + b'w' * (readers.MAX_LINE_CHARS + 1) + b'\n',
     'corpus.txt:2: line of 100001 characters exceeds the 100000 limit'),
    (b' \n\t\n', r'corpus.txt: no sentences \(the file is empty or blank\)'),
])
def test_bad_text_is_named_by_file_and_line(tmp_path, content, message):
    path = tmp_path / 'corpus.txt'
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        sources.TextSource(path)
    with pytest.raises(DataError, match=message):  # the same words as the whole-file reader
        readers.read_sentences(path)
    with pytest.raises(DataError, match='missing.txt: sentence file not found'):
        sources.TextSource(tmp_path / 'missing.txt')


def test_csv_source_reads_what_read_nli_csv_reads(tmp_path):
    path = tmp_path / 'nli.csv'
    path.write_bytes(b'sent0,sent1,hard_neg\r\n"a, b",c,"d ""e"""\r\n\r\n f ,g,h\n')
    src = sources.CsvSource(path)
    assert [src[i] for i in range(len(src))] == readers.read_nli_csv(path)
    assert src.views == 3 and len(src) == 2


@pytest.mark.parametrize('content, message', [
    (b'sent0,sent1,hard_neg\na,b,c\nd,e\n', r'nli.csv:3: expected 3 columns .* got 2'),
    (b'sent0,sent1,hard_neg\na,b,c\n\nd, ,f\n', "nli.csv:4: empty 'sent1'"),
    (b'sent0,sent1,hard_neg\na,"b,c\n', 'nli.csv:2: a quoted cell runs past the end'),
    (b'a,b,c\n', r"nli.csv:1: header \['a', 'b', 'c'\]"),
    (b'\nsent0,sent1,hard_neg\n', r'nli.csv:1: header \[\]'),
    (b'sent0,sent1,hard_neg\n', 'nli.csv: no triplets after the header'),
    (b'', r'nli.csv: empty file \(expected header sent0,sent1,hard_neg\)'),
])
def test_bad_csv_is_named_by_file_and_line(tmp_path, content, message):
    path = tmp_path / 'nli.csv'
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        sources.CsvSource(path)


def test_limited_takes_the_first_examples(tmp_path):
    path = tmp_path / 'corpus.txt'
    path.write_text('a\nb\nc\n')
    src = sources.Limited(sources.TextSource(path), 2)
    assert len(src) == 2 and src[1] == ('b',)
    with pytest.raises(IndexError):
        src[2]
    assert src.fingerprint() != sources.TextSource(path).fingerprint()


def test_snli_source_reads_the_triplets_of_build_snli_triplets(tmp_path):
    for split in ('dev', 'test'):
        for name in ('s1', 's2', 'labels'):
            f = f'{name}.{split}'
            (tmp_path / f).write_bytes((SENTEVAL_ROOT / 'SNLI' / f).read_bytes())
    src = sources.SnliSource(tmp_path, ('dev', 'test'))
    want = readers.build_snli_triplets(tmp_path, ('dev', 'test'))
    assert len(src) == len(want) and src.views == 3
    assert [src[i] for i in range(len(src))] == want
    assert sources.SnliSource(tmp_path, ('dev', 'test')).build_s == 0.0  # all cached


def test_snli_source_errors_as_the_reader(tmp_path):
    (tmp_path / 's1.dev').write_text('p1\np1\n \np1\np2\np2\np3\n')
    (tmp_path / 's2.dev').write_text('e1\nc1\nx\nn1\ne2\ne2b\nc3\n')
    (tmp_path / 'labels.dev').write_text(
        'entailment\ncontradiction\nentailment\nneutral\nentailment\nentailment\ncontradiction\n')
    src = sources.SnliSource(tmp_path, ['dev'])
    assert [src[i] for i in range(len(src))] == readers.build_snli_triplets(tmp_path, ['dev'])
    (tmp_path / 'labels.dev').write_text('entailment\n')
    with pytest.raises(DataError, match=r'labels\.dev:2: line missing'):
        sources.SnliSource(tmp_path, ['dev'])
    (tmp_path / 'labels.dev').write_text('entailment\ncontradiction\nneutral\nentailment\n'
                                         'entailed\ncontradiction\nneutral\n')
    with pytest.raises(DataError, match=r"labels\.dev:5: label 'entailed' is not one of"):
        sources.SnliSource(tmp_path, ['dev'])


def _same_times(path: Path, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _rewrite(path: Path, content: bytes, mtime_ns=None) -> None:
    """Rewrites the file in place (the reader's open file sees it), then sets its mtime."""
    st = path.stat()
    with path.open('r+b') as f:
        f.truncate(0)
        f.write(content)
    if mtime_ns is not None:
        os.utime(path, ns=(st.st_atime_ns, mtime_ns(st)))


def _replace(path: Path, content: bytes) -> None:
    """Another file renamed over the path, with the old one's size and mtime."""
    st = path.stat()
    other = path.with_name('other.txt')
    other.write_bytes(content)
    _same_times(other, st)
    os.replace(other, path)


ORIGINAL = b'one\ntwo\nthree\nfour\n'
CHANGES = {  # how the file changes -> what the error says
    'prefix': (lambda p: _rewrite(p, b'PREFIX LINE\n' + ORIGINAL),
               r'\(size 19 -> 31 bytes\)'),
    'truncated': (lambda p: _rewrite(p, b''), r'\(size 19 -> 0 bytes\)'),
    'same size, new mtime': (
        lambda p: _rewrite(p, ORIGINAL.upper(), lambda st: st.st_mtime_ns + 10**9),
        r'\(rewritten: modification time changed, same size\)'),
    # Same size and mtime (within one mtime tick, or restored): the lines no longer sit at
    # their offsets.
    'lines moved, same size and mtime': (
        lambda p: _rewrite(p, b'on\netwo\nthree\nfour\n', lambda st: st.st_mtime_ns),
        r'\(bytes 4-7 are no longer the line indexed there\)'),
    'replaced': (lambda p: _replace(p, ORIGINAL), r'\(replaced by another file\)'),
    'removed': (lambda p: p.unlink(), r'\(removed\)'),
}


@pytest.mark.parametrize('change', list(CHANGES))
def test_a_file_changed_under_its_reader_is_one_line_naming_it(tmp_path, change):
    path = tmp_path / 'corpus.txt'
    path.write_bytes(ORIGINAL)
    src = sources.TextSource(path)
    assert src.getitems([0, 1, 3]) == [('one',), ('two',), ('four',)]
    do, how = CHANGES[change]
    do(path)
    with pytest.raises(index.DataChangedError, match=(
            rf'^{re.escape(str(path))} changed during the run {how}; restore it, or start a new '
            r'run on it$')):
        src.getitems([1])
    with pytest.raises(index.DataChangedError):
        src[0]  # every read refuses, not only the first


def test_an_unchanged_file_reads_the_edge_records(tmp_path):
    # The line-boundary check at the edges: a byte-order mark, a last line without a line
    # break, CRLF lines, blank lines between.
    path = tmp_path / 'corpus.txt'
    path.write_bytes(b'\xef\xbb\xbffirst\r\n\n  \nsecond\nlast')
    src = sources.TextSource(path)
    assert src.getitems([2, 0, 1]) == [('last',), ('first',), ('second',)]
    lines = index.load_or_build(path, 'lines')
    assert lines.read_lines(lines.reader(), [0, 1, 2, 4]) == ['first\r', '', '  ', 'last']


def test_csv_and_snli_sources_refuse_a_changed_file(tmp_path):
    path = tmp_path / 'nli.csv'
    path.write_text('sent0,sent1,hard_neg\na,b,c\nd,e,f\n')
    src = sources.CsvSource(path)
    assert src[1] == ('d', 'e', 'f')
    _rewrite(path, b'sent0,sent1,hard_neg\nd,e,f\n')
    with pytest.raises(index.DataChangedError, match=rf'^{re.escape(str(path))} changed during '
                                                     r'the run \(size 33 -> 27 bytes\)'):
        src[1]
    for split in ('dev',):
        for name in ('s1', 's2', 'labels'):
            f = f'{name}.{split}'
            (tmp_path / f).write_bytes((SENTEVAL_ROOT / 'SNLI' / f).read_bytes())
    snli = sources.SnliSource(tmp_path, ['dev'])
    first = snli[0]
    s2 = tmp_path / 's2.dev'
    _rewrite(s2, b'PREFIX LINE\n' + (SENTEVAL_ROOT / 'SNLI' / 's2.dev').read_bytes())
    with pytest.raises(index.DataChangedError, match=rf'^{re.escape(str(s2))} changed during '):
        snli[0]
    assert first == readers.build_snli_triplets(SENTEVAL_ROOT / 'SNLI', ['dev'])[0]
