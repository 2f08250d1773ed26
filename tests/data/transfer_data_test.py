"""Readers of the SentEval transfer-task files: layouts, SentEval's parsing, clear errors."""
from __future__ import annotations

import numpy as np
import pytest

from jaxsim.data import transfer
from jaxsim.data.transfer import TransferDataError
from jaxsim.errors import JaxsimError
from jaxsim.storage.paths import SENTEVAL_ROOT


def _write(path, text, encoding='utf-8'):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
    return path


def test_binary_task_labels_order_blank_lines_and_latin1(tmp_path):
    # Latin-1 byte 0xe9 is 'é'; a blank line stays a sample (SentEval keeps it).
    _write(tmp_path / 'MR' / 'rt-polarity.pos', b'caf\xe9  is   good . \n\nfine\n')
    _write(tmp_path / 'MR' / 'rt-polarity.neg', 'bad movie\r\n')
    data = transfer.load_transfer_task('mr', tmp_path)
    split = data.splits['all']
    assert data.name == 'MR' and data.num_classes == 2
    assert split.sent1 == ['café is good .', '', 'fine', 'bad movie']
    np.testing.assert_array_equal(split.labels, [1, 1, 1, 0])
    assert set(data.files) == {'MR/rt-polarity.pos', 'MR/rt-polarity.neg'}
    assert all(h.startswith('sha256:') for h in data.files.values())


def test_subj_objective_is_label_one_and_downstream_layout(tmp_path):
    _write(tmp_path / 'downstream' / 'SUBJ' / 'subj.objective', 'the film opens in 1950 .\n')
    _write(tmp_path / 'downstream' / 'SUBJ' / 'subj.subjective', 'a lovely mess .\nyes\n')
    data = transfer.load_transfer_task('SUBJ', [tmp_path / 'nowhere', tmp_path])
    np.testing.assert_array_equal(data.splits['all'].labels, [1, 0, 0])
    assert data.root == str(tmp_path)


def test_trec_reader(tmp_path):
    _write(tmp_path / 'TREC' / 'train_5500.label',
           'DESC:manner How did serfdom develop ?\nNUM:date When was Ozzy born ?\n', 'latin-1')
    _write(tmp_path / 'TREC' / 'TREC_10.label', 'LOC:other Where is   Erie ?\n')
    data = transfer.load_transfer_task('trec', tmp_path)
    assert data.num_classes == 6
    assert data.splits['train'].sent1 == ['How did serfdom develop ?', 'When was Ozzy born ?']
    np.testing.assert_array_equal(data.splits['train'].labels, [1, 5])
    assert data.splits['test'].sent1 == ['Where is Erie ?']
    np.testing.assert_array_equal(data.splits['test'].labels, [4])


def test_mrpc_and_sst_readers(tmp_path):
    head = '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n'
    for s in ('train', 'test'):
        _write(tmp_path / 'MRPC' / f'msr_paraphrase_{s}.txt',
               head + '1\t1\t2\tA  cat .\tThe cat .\n0\t3\t4\tx\ty z\n')
    data = transfer.load_transfer_task('MRPC', tmp_path)
    assert data.splits['test'].sent1 == ['A cat .', 'x']
    assert data.splits['test'].sent2 == ['The cat .', 'y z']
    np.testing.assert_array_equal(data.splits['train'].labels, [1, 0])
    for s in ('train', 'dev', 'test'):
        _write(tmp_path / 'SST' / 'binary' / f'sentiment-{s}', 'good . \t1\nbad\t0\n')
    sst = transfer.load_transfer_task('sst-2', tmp_path)
    assert sst.name == 'SST2' and sst.splits['dev'].sent1 == ['good .', 'bad']
    np.testing.assert_array_equal(sst.splits['test'].labels, [1, 0])


@pytest.mark.parametrize('folder, name, text, expected', [
    ('SST/binary', 'sentiment-train', 'ok\t1\nno label here\n', r'sentiment-train:2: expected 2'),
    ('SST/binary', 'sentiment-train', 'ok\t1\nbad\t7\n', r'sentiment-train:2: label 7'),
    ('SST/binary', 'sentiment-train', 'ok\tpos\n', r'sentiment-train:1: label .pos. is not'),
    ('TREC', 'train_5500.label', 'DESC:manner How ?\nFOO:bar What ?\n',
     r'train_5500.label:2: unknown TREC class .FOO.'),
    ('TREC', 'train_5500.label', 'no colon at all\n', r'train_5500.label:1: expected COARSE'),
    ('MRPC', 'msr_paraphrase_train.txt', 'header\n1\t2\t3\tonly four\n',
     r'msr_paraphrase_train.txt:2: expected 5 tab-separated'),
    ('MRPC', 'msr_paraphrase_train.txt', 'header\n', r'msr_paraphrase_train.txt: no samples'),
])
def test_malformed_files_name_file_and_line(tmp_path, folder, name, text, expected):
    task = {'SST/binary': 'SST2', 'TREC': 'TREC', 'MRPC': 'MRPC'}[folder]
    _write(tmp_path / folder / name, text)
    with pytest.raises(TransferDataError, match=expected) as err:
        transfer.load_transfer_task(task, tmp_path)
    assert '\n' not in str(err.value) and isinstance(err.value, JaxsimError)


def test_bad_utf8_missing_file_and_missing_task(tmp_path):
    _write(tmp_path / 'SST' / 'binary' / 'sentiment-train', b'ok\t1\nbad \xff\t0\n')
    with pytest.raises(TransferDataError, match=r'sentiment-train:2: bytes are not valid utf-8'):
        transfer.load_transfer_task('SST2', tmp_path)
    _write(tmp_path / 'CR' / 'custrev.pos', 'good\n')
    with pytest.raises(TransferDataError, match=r'custrev.neg: file not found'):
        transfer.load_transfer_task('CR', tmp_path)
    _write(tmp_path / 'CR' / 'custrev.neg', '\n \n')
    with pytest.raises(TransferDataError, match=r'custrev.neg: no sentences'):
        transfer.load_transfer_task('CR', tmp_path)
    with pytest.raises(TransferDataError, match=r'MPQA: no task folder found; looked for'):
        transfer.load_transfer_task('MPQA', tmp_path)
    with pytest.raises(TransferDataError, match=r'unknown transfer task .STS12.; choose one of MR'):
        transfer.load_transfer_task('STS12', tmp_path)
    assert not transfer.has_task('MPQA', tmp_path) and transfer.has_task('cr', tmp_path)


def test_shipped_data_sizes_match_senteval():
    """SentEval's reported sample counts (CR and MPQA include their blank lines)."""
    sizes = {'MR': {'all': 10662}, 'CR': {'all': 3775}, 'MPQA': {'all': 10606},
             'SST2': {'train': 67349, 'dev': 872, 'test': 1821},
             'MRPC': {'train': 4076, 'test': 1725}}
    for name, expected in sizes.items():
        data = transfer.load_transfer_task(name, SENTEVAL_ROOT)
        assert {k: len(v) for k, v in data.splits.items()} == expected, name
