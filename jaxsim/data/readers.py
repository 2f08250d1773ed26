"""Readers of text data: sentence files, NLI CSV, SentEval SNLI triplets, TFDS, corpora.

Every reader returns plain Python data (strings, or tuples of strings) and raises DataError
naming the file and 1-based line for bad input: a missing or unreadable file, bytes that are
not UTF-8, a NUL byte (a binary file), a line over MAX_LINE_CHARS characters, malformed rows.

`read_sentences` is THE sentence-file reader: the encode command, calibration and export fit
sets, the unsupervised training corpus and search indexes all read sentence files with it, so a
file means the same sentences everywhere.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

from jaxsim.errors import JaxsimError

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
NLI_COLUMNS = ('sent0', 'sent1', 'hard_neg')
SNLI_LABELS = ('entailment', 'neutral', 'contradiction')
# No sentence is this long; a longer line is a file without line breaks (or not text at all).
MAX_LINE_CHARS = 100_000
_BOM = b'\xef\xbb\xbf'


class DataError(JaxsimError):
    """Bad data; the message names the file (and line)."""


def sha256_json(value) -> str:
    """'sha256:<hex>' of `value` as canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(',', ':'), ensure_ascii=False)
    return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Text files.
# ---------------------------------------------------------------------------------------------

def read_text(path: PathLike, what: str = 'file') -> str:
    """A file's text, validated: UTF-8 (a leading byte-order mark is dropped), no NUL byte,
    no line longer than MAX_LINE_CHARS characters; else a DataError naming the file (and line)
    and `what` the file is ('sentence file', 'NLI CSV', ...)."""
    return decode_text(read_bytes(path, what), path)


def read_bytes(path: PathLike, what: str = 'file') -> bytes:
    """A file's bytes; a missing, unreadable or non-regular path is a DataError naming it."""
    return read_checked(Path(path), what, Path.read_bytes)


def read_checked(path: Path, what: str, read: Callable[[Path], Any]) -> Any:
    """`read(path)`; a missing, unreadable or non-regular path is a DataError naming it."""
    if path.is_dir():
        raise DataError(f'{path}: is a directory, not a {what}')
    try:
        return read(path)
    except FileNotFoundError:
        raise DataError(f'{path}: {what} not found') from None
    except OSError as e:
        raise DataError(f'{path}: cannot read {what}: {e.strerror or e}') from None


def decode_text(data: bytes, path: PathLike) -> str:
    """Decodes a file's bytes as UTF-8 with the checks of `read_text` (errors name `path`)."""
    skip = len(_BOM) if data.startswith(_BOM) else 0
    try:
        text = data[skip:].decode('utf-8')
    except UnicodeDecodeError as e:
        at = e.start + skip
        line = data.count(b'\n', 0, at) + 1
        raise DataError(f'{path}:{line}: not valid UTF-8 ({e.reason} at byte {at})') from None
    nul = text.find('\x00')
    if nul >= 0:
        line = text.count('\n', 0, nul) + 1
        raise DataError(f'{path}:{line}: NUL byte (a binary file, not text)')
    if len(text) > MAX_LINE_CHARS:
        for lineno, line in enumerate(text.split('\n'), 1):
            if len(line) > MAX_LINE_CHARS:
                raise DataError(f'{path}:{lineno}: line of {len(line)} characters exceeds '
                                f'the {MAX_LINE_CHARS} limit (missing line breaks?)')
    return text


def text_lines(text: str) -> list[str]:
    """Lines split at '\\n' only, each without a trailing '\\r'; a final '\\n' ends the last
    line rather than starting an empty one."""
    lines = text.split('\n')
    if lines[-1] == '':
        lines.pop()
    return [ln[:-1] if ln.endswith('\r') else ln for ln in lines]


def read_sentences(path: PathLike) -> list[str]:
    """Reads a sentence file: UTF-8 text, one sentence a line.

    The rule, the same for every command: lines are split at '\\n' only (a '\\r' before it
    is dropped; U+2028 and other Unicode separators stay inside the sentence), surrounding
    whitespace is stripped, and blank lines are skipped. Sentence i is the i-th non-blank line.

    Raises:
      DataError: the file is missing, unreadable, a directory, not UTF-8, holds a NUL byte or
        an overlong line (naming file:line), or holds no sentence at all.
    """
    text = read_text(path, 'sentence file')
    sentences = [s for s in (line.strip() for line in text.split('\n')) if s]
    if not sentences:
        raise DataError(f'{path}: no sentences (the file is empty or blank)')
    return sentences


# The unsupervised training corpus is a sentence file.
read_corpus = read_sentences


def read_nli_csv(path: PathLike) -> list[tuple[str, str, str]]:
    """Supervised data: CSV with header `sent0,sent1,hard_neg` (the reference NLI format).

    Blank lines are skipped; cells are stripped of surrounding whitespace. A quoted cell may
    not run over a line break (an unbalanced quote).

    Raises:
      DataError: naming the file and line: the checks of `read_text`, a wrong header, a row
        with other than 3 columns or an empty cell, an unbalanced quote, or no row at all.
    """
    path = Path(path)
    text = read_text(path, 'NLI CSV file')
    reader = csv.reader(io.StringIO(text, newline=''), strict=True)
    rows = []
    try:
        header = next(reader, None)
        if header is None:
            raise DataError(f'{path}: empty file (expected header {",".join(NLI_COLUMNS)})')
        check_nli_header(header, path)
        end = 1  # last physical line of the previous row
        for row in reader:
            start, end = end + 1, reader.line_num
            if not row:
                continue
            if end != start:
                raise DataError(f'{path}:{start}: a quoted cell runs over {end - start + 1} '
                                f'lines (unbalanced quote?)')
            rows.append(check_nli_row(row, path, start))
    except csv.Error as e:
        raise DataError(f'{path}:{reader.line_num}: malformed CSV ({e})') from None
    if not rows:
        raise DataError(f'{path}: no triplets after the header')
    return rows


def check_nli_row(row: Sequence[str], path: PathLike, lineno: int) -> tuple[str, str, str]:
    """A parsed CSV row as a (sent0, sent1, hard_neg) triplet of stripped, non-empty cells."""
    if len(row) != 3:
        raise DataError(f'{path}:{lineno}: expected 3 columns {NLI_COLUMNS}, got {len(row)}')
    row = tuple(c.strip() for c in row)
    for name, cell in zip(NLI_COLUMNS, row):
        if not cell:
            raise DataError(f'{path}:{lineno}: empty {name!r}')
    return row


def check_nli_header(header: Sequence[str], path: PathLike) -> None:
    """Raises DataError unless the header is sent0,sent1,hard_neg."""
    header = [h.strip() for h in header]
    if tuple(header) != NLI_COLUMNS:
        raise DataError(f'{path}:1: header {header} != {list(NLI_COLUMNS)}')


def build_snli_triplets(snli_dir: PathLike, splits: Sequence[str] = ('dev', 'test')
                        ) -> list[tuple[str, str, str]]:
    """(premise, entailment, contradiction) triplets from SentEval's SNLI files.

    SentEval ships `s1.<split>` (premises), `s2.<split>` (hypotheses) and `labels.<split>`, one
    pair per line. Hypotheses are grouped by premise; each entailment is paired with a
    contradiction of the same premise (cycling when counts differ), the construction behind the
    reference's `nli_for_simcse.csv`. Premises lacking either label are dropped, and so are
    lines whose premise or hypothesis is blank.

    Raises:
      DataError: naming the file and line: the checks of `read_text`, files of different
        lengths (at the first line one of them lacks), a label other than SNLI's three.
    """
    snli_dir = Path(snli_dir)
    triplets = []
    for split in splits:
        files = [snli_dir / f'{name}.{split}' for name in ('s1', 's2', 'labels')]
        columns = [text_lines(read_text(f, 'SNLI file')) for f in files]
        check_paired(files, [len(c) for c in columns])
        triplets += [(columns[0][p].strip(), columns[1][e].strip(), columns[1][c].strip())
                     for p, e, c in snli_triplet_lines(zip(*columns), files[2])]
    if not triplets:
        raise DataError(f'{snli_dir}: no (entailment, contradiction) pairs found')
    return triplets


def check_paired(files: Sequence[Path], counts: Sequence[int]) -> None:
    """Raises DataError at the first line one of `files` lacks, unless all have `counts` equal."""
    if len(set(counts)) != 1:
        n = min(counts)
        listed = ', '.join(f'{f.name}: {c}' for f, c in zip(files, counts))
        raise DataError(f'{files[counts.index(n)]}:{n + 1}: line missing; the files must pair up '
                        f'line by line ({listed} lines)')


def snli_triplet_lines(rows: Iterable[Sequence[str]], labels_path: PathLike
                       ) -> list[tuple[int, int, int]]:
    """The 0-based lines (premise, entailment, contradiction) of the SNLI triplets of `rows`,
    the (s1, s2, label) lines of one split; see `build_snli_triplets`."""
    groups: dict[str, dict[str, list[int]]] = {}
    for lineno, (premise, hyp, label) in enumerate(rows):
        premise, hyp, label = premise.strip(), hyp.strip(), label.strip()
        if label not in SNLI_LABELS:
            raise DataError(f'{labels_path}:{lineno + 1}: label {label[:40]!r} is not one of '
                            f'{", ".join(SNLI_LABELS)}')
        if premise and hyp:
            groups.setdefault(premise, {}).setdefault(label, []).append(lineno)
    triplets = []
    for by_label in groups.values():  # dicts keep first-seen order
        ent, con = by_label.get('entailment', []), by_label.get('contradiction', [])
        if con:  # the premise is s1 at the entailment's own line
            triplets += [(line, line, con[k % len(con)]) for k, line in enumerate(ent)]
    return triplets


def write_nli_csv(triplets: Sequence[tuple[str, str, str]], path: str | Path) -> Path:
    """Writes triplets in the reference CSV format (header sent0,sent1,hard_neg)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open('w', encoding='utf-8', newline='') as f:
        w = csv.writer(f)
        w.writerow(NLI_COLUMNS)
        w.writerows(triplets)
    return path


def read_tfds(name: str, split: str = 'train', data_dir: str | None = None,
              fields: Sequence[str] = ('text',)) -> list[tuple[str, ...]]:
    """Rows from a TensorFlow Datasets dataset via its data source (no TensorFlow needed).

    Works for datasets prepared with `file_format='array_record'`. `name` is a registered TFDS
    name (optionally 'name:version', found under `data_dir`), or the folder of a prepared
    dataset version (e.g. '~/tensorflow_datasets/my_corpus/1.0.0'), which needs no builder code.
    `split` may slice ('train[:10%]'); `fields`: the string features of an example, in order
    (sent0, sent1, hard_neg for sup).
    """
    _, source = open_tfds(name, split, data_dir)
    rows = [tfds_row(source[i], fields, f'TFDS {name!r} example {i}') for i in range(len(source))]
    rows = [row for row in rows if all(row)]
    if not rows:
        raise DataError(f'TFDS {name!r} split {split!r}: no non-empty examples')
    return rows


def open_tfds(name: str, split: str, data_dir: str | None):
    """(builder, data source) of a TFDS split, `name` as `read_tfds` takes it."""
    import tensorflow_datasets as tfds  # heavy import, only for users of TFDS data
    try:
        folder = Path(name).expanduser()
        builder = (tfds.builder_from_directory(str(folder)) if folder.is_dir()
                   else tfds.builder(name, data_dir=data_dir))
        return builder, builder.as_data_source(split=split)
    except Exception as e:
        # An unknown name's message goes on to list every dataset TFDS knows: cut there,
        # keeping its suggestion.
        text = ' '.join(str(e).split())
        reason = text.split(' Available datasets:')[0]
        suggestion = re.search(r'Did you mean:? [^?]*\?', text)
        if suggestion and suggestion.group(0) not in reason:
            reason += ' ' + suggestion.group(0)
        raise DataError(f'TFDS {name!r} split {split!r} (data_dir={data_dir}): cannot open: '
                        f'{type(e).__name__}: {reason[:300]}') from None


def tfds_row(example, fields: Sequence[str], where: str) -> tuple[str, ...]:
    """The string `fields` of a TFDS example, stripped; a missing one is a DataError at `where`."""
    row = []
    for field in fields:
        if field not in example:
            raise DataError(f'{where}: no field {field!r} (has {sorted(example)})')
        v = example[field]
        row.append((v.decode('utf-8') if isinstance(v, bytes) else str(v)).strip())
    return tuple(row)


# Plain one-sentence-per-line SentEval files usable as an unsupervised corpus. STS files are
# deliberately absent: training on evaluation sentences would leak.
CORPUS_FILES = ('SNLI/s1.dev', 'SNLI/s2.dev', 'SNLI/s1.test', 'SNLI/s2.test',
                'MR/rt-polarity.pos', 'MR/rt-polarity.neg', 'CR/custrev.pos', 'CR/custrev.neg',
                'MPQA/mpqa.pos', 'MPQA/mpqa.neg')


def collect_corpus(senteval_root: PathLike, files: Sequence[str] = CORPUS_FILES,
                   min_words: int = 3) -> list[str]:
    """Deduplicated sentences (first-seen order) of `files` under the SentEval data folder,
    fragments under `min_words` words dropped (MPQA holds many 1-2 word phrases)."""
    root = Path(senteval_root)
    seen, sentences = set(), []
    for rel in files:
        for s in read_sentences(root / rel):
            if len(s.split()) >= min_words and s not in seen:
                seen.add(s)
                sentences.append(s)
    if not sentences:
        raise DataError(f'{root}: no sentences of {min_words}+ words in {list(files)}')
    return sentences


def build_unsup_corpus(senteval_root: str | Path, out_path: str | Path,
                       files: Sequence[str] = CORPUS_FILES, min_words: int = 3) -> Path:
    """Writes `collect_corpus(...)` as a one-sentence-per-line corpus file; returns its path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sentences = collect_corpus(senteval_root, files, min_words)
    out_path.write_text('\n'.join(sentences) + '\n', encoding='utf-8')
    return out_path
