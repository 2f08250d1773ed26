"""The run record of a workdir: same run resumes, another is refused in one line, allowed
changes are recorded; the metrics log drops rows past the restored step; strict JSON."""
import json
import math

import pytest

from jaxsim.storage import store
from jaxsim.train import records
from jaxsim.train.config import TrainConfig

DERIVED = {'data': {'source': 'c.txt', 'examples': 10, 'sha256': 'sha256:aa'},
           'grad_divisor': 1.0}


def _record(**changes):
    derived = {**DERIVED, **changes.pop('derived', {})}
    return records.make_record(TrainConfig(train_file='c.txt', **changes), derived,
                               {'total_steps': 5})


def test_new_same_other_and_allowed_runs(tmp_path):
    d = records.check_workdir(tmp_path, _record())
    assert not d.resume and d.changed == {}
    store.write_json(tmp_path / 'config.json', d.record)
    same = records.check_workdir(tmp_path, _record(mesh_data=2, log_every=1), step=3)
    assert same.resume and same.changed == {}
    assert same.record['changes'] == [{'at_step': 3, 'allowed': {},
                                       'operational': {'mesh_data': [-1, 2],
                                                       'log_every': [10, 1]}}]
    with pytest.raises(records.RunMismatchError) as e:
        records.check_workdir(tmp_path, _record(max_steps=9, derived={'grad_divisor': 4.0}))
    message = str(e.value)
    assert '\n' not in message
    assert 'max_steps 0 -> 9' in message and 'grad_divisor 1.0 -> 4.0' in message
    assert message.endswith('--allow-change=grad_divisor,max_steps')
    allowed = records.check_workdir(tmp_path, _record(max_steps=9), allow=('max_steps',), step=4)
    assert allowed.resume and allowed.changed == {'max_steps': (0, 9)}
    assert allowed.record['changes'][-1] == {'at_step': 4, 'allowed': {'max_steps': [0, 9]},
                                             'operational': {}}
    # Changed training data is a difference too, named 'data': by the entry that differs.
    with pytest.raises(records.RunMismatchError,
                       match=r'\(data.sha256 "sha256:aa" -> "sha256:bb"\); .*'
                             r'--allow-change=data$'):
        records.check_workdir(tmp_path, _record(derived={'data': {**DERIVED['data'],
                                                                  'sha256': 'sha256:bb'}}))
    # Two long values that begin alike are shown where they differ.
    digest = 'sha256:' + '0' * 60
    with pytest.raises(records.RunMismatchError) as e:
        records.check_workdir(tmp_path, _record(derived={'data': {**DERIVED['data'],
                                                                  'sha256': digest}}))
    assert 'data.sha256 "sha256:aa" -> "sha256:0000' in str(e.value)
    store.write_json(tmp_path / 'config.json', _record(derived={'data': {
        **DERIVED['data'], 'sha256': digest + 'a'}}))
    with pytest.raises(records.RunMismatchError) as e:
        records.check_workdir(tmp_path, _record(derived={'data': {**DERIVED['data'],
                                                                  'sha256': digest + 'b'}}))
    old, new = str(e.value).split('(data.sha256 ')[1].split(');')[0].split(' -> ')
    assert old != new and old.endswith('0a"') and new.endswith('0b"'), (old, new)


def test_keys_added_since_the_run_started_count_at_their_default(tmp_path):
    old = _record()
    del old['config']['eval_at_end'], old['config']['last_batch']  # absent from older records
    store.write_json(tmp_path / 'config.json', old)
    assert records.check_workdir(tmp_path, _record()).changed == {}
    with pytest.raises(records.RunMismatchError, match='last_batch "drop" -> "keep"'):
        records.check_workdir(tmp_path, _record(last_batch='keep'))


def test_foreign_folders_are_refused(tmp_path):
    (tmp_path / 'config.json').write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(records.RunMismatchError, match='not a jaxsim train record'):
        records.check_workdir(tmp_path, _record())
    other = tmp_path / 'o'
    (other / 'checkpoints').mkdir(parents=True)
    with pytest.raises(records.RunMismatchError, match='holds checkpoints but no config.json'):
        records.check_workdir(other, _record())
    # What a run leaves before its record (its lock, an interrupted write's temporary file) is
    # its own; anything else is the user's.
    fresh = tmp_path / 'fresh'
    fresh.mkdir()
    (fresh / '.lock').write_text('{}')
    (fresh / '.config.json.tmp-123-0123abcd').write_text('{')
    assert not records.check_workdir(fresh, _record()).resume
    (fresh / 'model.json').write_text('{}')
    with pytest.raises(records.RunMismatchError, match=r'holds files jaxsim did not write '
                                                       r'\(model.json\)'):
        records.check_workdir(fresh, _record())
    seeds = tmp_path / 'seeds'
    (seeds / 'seed_1').mkdir(parents=True)
    (seeds / 'seeds_summary.json').write_text('{}')
    records.check_seeds_workdir(seeds)
    (seeds / 'run.log').write_text('')
    with pytest.raises(records.RunMismatchError, match=r'\(run.log\)'):
        records.check_seeds_workdir(seeds)
    (tmp_path / 'file').write_text('x')
    with pytest.raises(records.RunMismatchError, match='is not a folder'):
        records.check_writable(tmp_path / 'file' / 'run')


def test_metrics_log_continues_from_the_restored_step(tmp_path):
    log = records.MetricsLog(tmp_path, keep_upto=None)
    for step in range(1, 6):
        log.write(step, {'loss': 1.0 / step})
    log.close()
    with (tmp_path / 'metrics.jsonl').open('a') as f:
        f.write('{"step": 6, "lo')  # a row torn by a kill
    log = records.MetricsLog(tmp_path, keep_upto=3)
    assert [r['step'] for r in log.rows] == [1, 2, 3]
    log.write(4, {'loss': math.nan, 'stsb_dev': 70.0})
    with pytest.raises(ValueError, match='row for step 4 after step 4'):
        log.write(4, {'loss': 1.0})
    log.close()
    rows = [json.loads(x) for x in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in rows] == [1, 2, 3, 4] and rows[-1] == {
        'step': 4, 'loss': None, 'stsb_dev': 70.0}
    assert [r['step'] for r in records.MetricsLog(tmp_path, None, enabled=False).rows] == []


def test_a_new_run_that_fails_to_start_is_undone(tmp_path):
    def write_run(folder):
        folder.mkdir()
        for name in ('config.json', 'model.json', 'metrics.jsonl'):
            (folder / name).write_text('{}')
        for name in ('tokenizer', 'checkpoints', 'tb'):
            (folder / name).mkdir()
            (folder / name / 'f').write_text('x')
        (folder / '.lock').write_text('{}')

    for new_run, started, kept in ((True, False, ['.lock']), (True, True, None),
                                   (False, False, None)):
        folder = tmp_path / f'{new_run}-{started}'
        write_run(folder)
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(records.RunMismatchError):
            with records.undone_if_it_fails_to_start(folder, new_run) as start:
                if started:
                    start.started()
                raise records.RunMismatchError('fails')
        assert sorted(p.name for p in folder.iterdir()) == (kept or before)
# ---- code in the fingerprint: the objective's source ---------------------------------------

_LOSS_MODULE = '''
import jax.numpy as jnp
from jaxsim.objectives import register_objective

SCALE = 2.0


def _helper(z):
    return jnp.mean(z) * SCALE


def unrelated():
    return 1


@register_objective('test_code_obj', views=2, from_single=True, replace=True)
def code_loss(z, temp=0.1):
    return _helper(z) / temp, {}
'''


def _import_user_module(tmp_path, name: str, source: str) -> None:
    """Writes the user's module `name` and imports it afresh (as a new process would): its
    registrations replace the previous version's."""
    import importlib.util
    import sys
    path = tmp_path / f'{name}.py'
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no stale .pyc
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write


def _load_objective(tmp_path, source):
    from jaxsim.objectives import get_objective
    _import_user_module(tmp_path, 'lab_losses', source)
    return get_objective('test_code_obj')


def test_the_code_digest_follows_the_loss_its_helpers_and_constants(tmp_path):
    from jaxsim.train.fingerprint import code_digests
    first = code_digests(_load_objective(tmp_path, _LOSS_MODULE))
    assert set(first) == {'objective'} and first['objective'].startswith('sha256:')
    assert code_digests(_load_objective(tmp_path, _LOSS_MODULE)) == first  # same code, same run
    # Code the loss does not use is not part of the run.
    assert code_digests(_load_objective(
        tmp_path, _LOSS_MODULE.replace('return 1', 'return 10'))) == first
    for edit in [('/ temp', '/ (2 * temp)'),          # the loss itself
                 ('* SCALE', '* SCALE + 1.0'),          # a helper of its module
                 ('SCALE = 2.0', 'SCALE = 2.50')]:      # a constant a helper reads
        edited = code_digests(_load_objective(tmp_path, _LOSS_MODULE.replace(*edit)))
        assert edited != first, edit


def test_a_loss_without_source_is_hashed_by_its_code():
    from jaxsim.train.fingerprint import source_digest
    made = [{}, {}, {}]
    exec('def f(z, temp=0.1):\n    return z / temp', made[0])
    exec('def f(z, temp=0.1):\n    return z / temp', made[1])
    exec('def f(z, temp=0.1):\n    return z * temp', made[2])
    digests = [source_digest(m['f']) for m in made]
    assert digests[0] == digests[1] != digests[2]

    class Scaled:  # a callable object: its class's source
        def __call__(self, z, temp=0.1):
            return z / temp

    class Shifted:
        def __call__(self, z, temp=0.1):
            return z - temp

    assert source_digest(Scaled()) == source_digest(Scaled()) != source_digest(Shifted())


# The built-in objectives' and poolers' code digests as every existing run recorded them (commit
# 28728b7). A change here, even to a decorator line, makes those runs refuse to resume as "another
# run": update a value only for an edit that really makes other runs.
_BUILTIN_DIGESTS = {
    'objective:sup': {
        'objective':
            'sha256:1e58422f9f951d86da5266df2fd4006791402aed4ac333a8ece1fe865e813079',
        'objective_params':
            'sha256:6eb2a07aa5dbf034ff7c4106f681e3873084b6fb2052d92a9a6c35b260b0978b',
    },
    'objective:unsup': {
        'objective':
            'sha256:43bd94e533d89ebfc5de8ae31321c29d93537a2500370bb86c3b257158e404f7',
        'objective_params':
            'sha256:6eb2a07aa5dbf034ff7c4106f681e3873084b6fb2052d92a9a6c35b260b0978b',
    },
    'pooler:avg':
        'sha256:5d167fa332dab1183b69067fc540c79b10fe152981045d64d2c9044d3d207c4a',
    'pooler:avg_embed_last':
        'sha256:43f778c27507b21d08a03256ca76b920e8916bf03b277bee14f5463c841d4be4',
    'pooler:avg_first_last':
        'sha256:43f778c27507b21d08a03256ca76b920e8916bf03b277bee14f5463c841d4be4',
    'pooler:avg_top2':
        'sha256:43f778c27507b21d08a03256ca76b920e8916bf03b277bee14f5463c841d4be4',
    'pooler:cls':
        'sha256:cfcc4ddeaddf34ca2b1a3d1899b7156ea04e72c0e4bc30b6933f11ace805fe15',
    'pooler:cls_before_pooler':
        'sha256:f127651dd99c9ae3354c0d7b161b06ba4fa53e282d223a2b3f54a3ddb829a6d2',
}


def test_builtin_code_digests_are_those_existing_runs_recorded():
    from jaxsim.models.poolers import BUILTIN_POOLERS, POOLERS
    from jaxsim.objectives import OBJECTIVES
    from jaxsim.train.fingerprint import code_digests
    found = {f'objective:{name}': code_digests(OBJECTIVES.get(name)) for name in ('sup', 'unsup')}
    found.update({f'pooler:{name}': code_digests(OBJECTIVES.get('unsup'), POOLERS.get(name))[
        'pooler'] for name in BUILTIN_POOLERS})
    assert found == _BUILTIN_DIGESTS

def test_an_edited_objective_is_another_run_refused_naming_it(tmp_path):
    from jaxsim.train.fingerprint import code_digests
    work = tmp_path / 'w'
    work.mkdir()

    def record(source):
        code = code_digests(_load_objective(tmp_path, source))
        return _record(objective='test_code_obj', derived={'code': code})

    store.write_json(work / 'config.json', records.check_workdir(work, record(_LOSS_MODULE))
                     .record)
    assert records.check_workdir(work, record(_LOSS_MODULE)).changed == {}
    edited = _LOSS_MODULE.replace('/ temp', '/ (2 * temp)')
    with pytest.raises(records.RunMismatchError) as e:
        records.check_workdir(work, record(edited))
    message = str(e.value)
    assert '\n' not in message
    assert "(the source of objective 'test_code_obj' changed (sha256:" in message
    assert message.endswith('--allow-change=code')
    allowed = records.check_workdir(work, record(edited), allow=('code',), step=2)
    assert allowed.resume and set(allowed.changed) == {'code'}
    # A run recorded before code was hashed resumes: there is nothing to compare.
    old = record(_LOSS_MODULE)
    del old['derived']['code']
    store.write_json(work / 'config.json', old)
    assert records.check_workdir(work, record(edited)).changed == {}


_POOLER_MODULE = '''
import jax.numpy as jnp
from jaxsim.models.poolers import masked_mean, register_pooler

WEIGHT = 1.0


@register_pooler('test_code_pool', replace=True)
def test_code_pool(output, attention_mask):
    return masked_mean(output.hidden_states[-1], attention_mask) * WEIGHT
'''


def _load_pooler(tmp_path, source):
    from jaxsim.models.poolers import get_pooler
    _import_user_module(tmp_path, 'lab_poolers', source)
    return get_pooler('test_code_pool')


def test_an_edited_pooler_is_another_run_refused_naming_it(tmp_path):
    from jaxsim.objectives import get_objective
    from jaxsim.train.fingerprint import code_digests
    work = tmp_path / 'w'
    work.mkdir()

    def record(source):
        code = code_digests(get_objective('unsup'), _load_pooler(tmp_path, source))
        return _record(pooler='test_code_pool', derived={'code': code})

    first = record(_POOLER_MODULE)
    assert set(first['derived']['code']) == {'objective', 'objective_params', 'pooler'}
    store.write_json(work / 'config.json', records.check_workdir(work, first).record)
    assert records.check_workdir(work, record(_POOLER_MODULE)).changed == {}
    for edit in [('* WEIGHT', '* WEIGHT * 2'), ('WEIGHT = 1.0', 'WEIGHT = 1.5')]:
        with pytest.raises(records.RunMismatchError) as e:
            records.check_workdir(work, record(_POOLER_MODULE.replace(*edit)))
        message = str(e.value)
        assert '\n' not in message and message.endswith('--allow-change=code')
        assert "(the source of pooler 'test_code_pool' changed (sha256:" in message
        assert 'objective' not in message.split('(', 1)[1].split('--allow')[0]
    edited = record(_POOLER_MODULE.replace('* WEIGHT', '* WEIGHT * 2'))
    assert set(records.check_workdir(work, edited, allow=('code',)).changed) == {'code'}
    # A run recorded when only the objective was hashed resumes: the pooler is not compared.
    old = record(_POOLER_MODULE)
    old['derived']['code'] = {'objective': old['derived']['code']['objective']}
    store.write_json(work / 'config.json', old)
    assert records.check_workdir(work, edited).changed == {}


_CLASS_POOLER_MODULE = '''
import flax.linen as nn
import jax.numpy as jnp
from jaxsim.models.poolers import masked_mean, register_pooler


def _squash(x):
    return jnp.tanh(x)


@register_pooler('test_code_pool', replace=True)
class TestCodePool(nn.Module):
    config: object
    dtype: object = jnp.float32

    def __call__(self, output, attention_mask, use_head=True):
        return _squash(masked_mean(output.hidden_states[-1], attention_mask))
'''


def test_a_pooler_class_is_hashed_with_the_helpers_its_methods_use(tmp_path):
    from jaxsim.train.fingerprint import source_digest
    first = source_digest(_load_pooler(tmp_path, _CLASS_POOLER_MODULE).source)
    assert source_digest(_load_pooler(tmp_path, _CLASS_POOLER_MODULE).source) == first
    edited = _CLASS_POOLER_MODULE.replace('jnp.tanh(x)', 'jnp.tanh(2 * x)')  # the helper only
    assert source_digest(_load_pooler(tmp_path, edited).source) != first


def test_a_metrics_row_the_disk_cannot_take_names_the_log(tmp_path):
    """A full disk mid-run printed a bare '[Errno 28] No space left on device'."""
    log = records.MetricsLog(tmp_path, keep_upto=None)
    log.write(1, {'loss': 1.0})

    class FullDisk:
        def write(self, text):
            raise OSError(28, 'No space left on device')

        def close(self):
            pass

    log._file = FullDisk()
    with pytest.raises(store.StorageError) as e:
        log.write(2, {'loss': 0.5})
    assert str(e.value) == (f'{tmp_path / "metrics.jsonl"}: cannot append the row of step 2: '
                            f'No space left on device; the checkpoints are kept: free space '
                            f'and rerun to resume')
    log.close()
