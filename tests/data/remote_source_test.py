"""A training corpus on gs:// (a real GCS server on localhost, fake-gcs-server): indexed once
into the local index cache, read with ranged reads, the same examples, digest and batches as a
local copy."""
import numpy as np
import pytest
from etils import epath

from jaxsim import bundled_model_path
from jaxsim.data import index, pipeline, sources
from jaxsim.formats.hf_folder import load_tokenizer
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.storage.remote_test import BUCKET, gcs  # noqa: F401 (the server fixture)


def test_remote_corpus_reads_as_its_local_copy(gcs, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv('JAXSIM_INDEX_DIR', str(tmp_path / 'index-cache'))
    lines = (SENTEVAL_ROOT / 'SNLI' / 's2.dev').read_text().splitlines()[:300]
    local = tmp_path / 'corpus.txt'
    local.write_text('\n \n'.join(lines) + '\n')
    url = f'gs://{BUCKET}/data/corpus.txt'
    epath.Path(url).write_bytes(local.read_bytes())
    remote, want = sources.TextSource(url), sources.TextSource(local)
    assert remote.build_s > 0 and len(remote) == len(want) == 300
    assert remote.getitems(list(range(300))) == [want[i] for i in range(300)]
    assert remote.fingerprint() == want.fingerprint()
    # Both indexes (the remote file's, the local copy's) in the cache folder, none beside.
    assert len(list((tmp_path / 'index-cache').glob('*-corpus.txt.text-index.npy'))) == 2
    assert not (tmp_path / 'corpus.txt.text-index.npy').exists()
    assert not epath.Path(f'gs://{BUCKET}/data/corpus.txt.text-index.json').exists()
    assert sources.TextSource(url).build_s == 0.0  # the cached index is reused
    tokenizer = load_tokenizer(bundled_model_path())
    a = pipeline.StreamIterator(remote, tokenizer, 16, 32, seed=1)
    b = pipeline.StreamIterator(want, tokenizer, 16, 32, seed=1)
    for _ in range(12):  # past the epoch boundary
        np.testing.assert_array_equal(next(a)['input_ids'], next(b)['input_ids'])
    a.close()
    b.close()


def test_a_remote_corpus_rewritten_while_read_is_refused(gcs, tmp_path, monkeypatch):  # noqa: F811
    # An object store cannot rewrite in place, but a new version under the same name is read
    # through the old offsets all the same: its new version (same size here) stops the reads.
    monkeypatch.setenv('JAXSIM_INDEX_DIR', str(tmp_path / 'index-cache'))
    url = f'gs://{BUCKET}/data/edited.txt'
    epath.Path(url).write_bytes(b'one\ntwo\nthree\n')
    src = sources.TextSource(url)
    assert src.getitems([0, 2]) == [('one',), ('three',)]
    epath.Path(url).write_bytes(b'ONE\nTWO\nTHREE\n')
    with pytest.raises(index.DataChangedError, match=rf'^{url} changed during the run '
                                                     r'\(rewritten: new version, same size\)'):
        src.getitems([1])
