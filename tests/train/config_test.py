"""TrainConfig: validation, config files, --config overrides, fingerprints, the paper configs."""
import ast
import math
from pathlib import Path

import numpy as np
import pytest

from jaxsim.data.batching import BatchIterator
from jaxsim.errors import ConfigError
from jaxsim.train.config import TrainConfig, base_config
from jaxsim.train.config_files import apply_overrides, load_config_file
from jaxsim.train.fingerprint import differences, fingerprint, parse_key_list, run_defining

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (REPO / 'configs').glob('*.py') if not p.name.startswith('flow_'))


def _imports(path):
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split('.')[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split('.')[0])
    return names


def test_config_modules_and_config_files_import_no_jax():
    for name in ('config.py', 'config_files.py', 'fingerprint.py'):
        imported = _imports(REPO / 'jaxsim' / 'train' / name)
        assert not imported & {'jax', 'jaxlib', 'flax', 'optax', 'orbax'}, name
    for path in CONFIGS:
        assert _imports(path) <= {'ml_collections'}, path.name


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: p.stem)
def test_every_config_file_gives_a_valid_train_config(path):
    fields = load_config_file(str(path))
    if not fields['train_file'] and fields['data_format'] in ('text', 'csv'):
        fields['train_file'] = 'corpus.txt'
    cfg = TrainConfig.from_dict(fields)
    assert cfg.objective in ('unsup', 'sup') and cfg.objective_kwargs['temp'] == 0.05


def test_unknown_keys_are_one_line_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown config key 'learnign_rate' \(did you mean "
                                          r"'learning_rate'\?\)$"):
        apply_overrides(base_config(), ['learnign_rate=1'])
    with pytest.raises(ConfigError, match=r"train config: unknown config key 'zzz'$"):
        TrainConfig.from_dict({'zzz': 1})
    bad = tmp_path / 'cfg.py'
    bad.write_text('import ml_collections\ndef get_config():\n'
                   '    return ml_collections.ConfigDict({"batchsize": 8})\n')
    with pytest.raises(ConfigError, match=r"cfg.py: unknown config key 'batchsize' \(did you "
                                          r"mean 'batch_size'\?\)"):
        load_config_file(str(bad))
    bad.write_text('def get_config(:\n')
    with pytest.raises(ConfigError, match=r'cfg.py:1: syntax error'):
        load_config_file(str(bad))
    with pytest.raises(ConfigError, match='nope.py: no such config file'):
        load_config_file(str(tmp_path / 'nope.py'))
    # The file's own code failing (a typo'd name, at import or in get_config) is the file's
    # line, not a traceback.
    bad.write_text('import ml_collectionz\n')
    with pytest.raises(ConfigError, match=r"cfg.py:1: ModuleNotFoundError: No module named "):
        load_config_file(str(bad))
    bad.write_text('import ml_collections\ndef get_config():\n'
                   '    return ml_collection.ConfigDict({"batch_size": 8})\n')
    with pytest.raises(ConfigError, match=r"cfg.py:3: NameError: name 'ml_collection' is not"):
        load_config_file(str(bad))


def test_a_syntax_error_in_an_imported_module_names_that_module(tmp_path, monkeypatch):
    """Its own file and line, not the config's name with the other file's line."""
    from jaxsim.flows import FlowError
    from jaxsim.flows.config import load_config_file as load_flow_config_file

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / 'broken_helper_cfg.py').write_text('import numpy\n\n\ndef f(x):\n'
                                                   '    return x +\n')
    (tmp_path / 'imports_broken.py').write_text('import broken_helper_cfg  # noqa\n\n\n\n\n'
                                                'def get_config():\n    return {}\n')
    with pytest.raises(ConfigError) as e:
        load_config_file('imports_broken.py')
    assert str(e.value) == 'imports_broken.py: broken_helper_cfg.py:5: syntax error: invalid syntax'
    # Flow configs (`--post flow:CONFIG`) go through the same loader.
    with pytest.raises(FlowError) as e:
        load_flow_config_file('imports_broken.py')
    assert str(e.value) == 'imports_broken.py: broken_helper_cfg.py:5: syntax error: invalid syntax'
    # The config's own syntax error is still its own line.
    (tmp_path / 'self_broken.py').write_text('\n\ndef get_config(:\n')
    with pytest.raises(ConfigError) as e:
        load_config_file('self_broken.py')
    assert str(e.value) == 'self_broken.py:3: syntax error: invalid syntax'


def test_overrides_parse_by_field_type():
    base = base_config()
    out = apply_overrides(base, [
        'batch_size=32', 'learning_rate=1e-4', 'eval_at_start=false', 'pooler=avg',
        'snli_splits=dev', 'model_overrides.hidden_size=48', 'objective_kwargs.temp=0.1',
        'objective_kwargs.name=abc', 'tfds_fields=[\'a\', \'b\']'])
    cfg = TrainConfig.from_dict({**out, 'train_file': 'x'})
    assert cfg.batch_size == 32 and cfg.learning_rate == 1e-4 and cfg.eval_at_start is False
    assert cfg.pooler == 'avg' and cfg.snli_splits == ('dev',) and cfg.tfds_fields == ('a', 'b')
    assert cfg.model_overrides == {'hidden_size': 48}
    assert cfg.objective_kwargs == {'temp': 0.1, 'name': 'abc'}
    for item, message in [('batch_size=abc', 'expected an integer'),
                          ('eval_test=maybe', 'expected true or false'),
                          ('learning_rate=fast', 'expected a number'),
                          ('pooler.x=1', "'pooler' is not a dict field"),
                          ('batch_size', 'expected --config.KEY=VALUE')]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(base, [item])


@pytest.mark.parametrize('change, message', [
    ({'batch_size': 0}, 'batch_size must be >= 1, got 0'),
    ({'batch_size': 10, 'grad_accum_steps': 3}, 'not divisible by grad_accum_steps 3'),
    ({'learning_rate': math.inf}, 'learning_rate must be a finite number >= 0'),
    ({'dtype': 'float16'}, "dtype must be one of float32, bfloat16, got 'float16'"),
    ({'last_batch': 'pad'}, 'last_batch must be one of drop, keep'),
    ({'grad_reduction': 'sum'}, 'grad_reduction must be one of global_mean, replica_mean'),
    ({'batch_size': '8'}, "batch_size must be a int, got '8'"),
    ({'max_steps': 0, 'num_epochs': 0.0}, 'set num_epochs > 0 or max_steps > 0'),
    ({'train_file': ''}, "train_file is empty"),
    ({'dropout': 1.5}, 'dropout must be < 1'),
    ({'objective_kwargs': {'temp': math.nan}}, 'values must be plain JSON data'),
])
def test_bad_values_are_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{'train_file': 'x', **change})


def test_snli_and_senteval_corpus_default_to_the_senteval_root():
    cfg = TrainConfig(data_format='snli', senteval_root='/data/se')
    assert cfg.data_path == '/data/se/SNLI'
    assert TrainConfig(data_format='senteval_corpus', senteval_root='/d').data_path == '/d'
    assert TrainConfig(data_format='snli', train_file='/x').data_path == '/x'


def test_fingerprint_ignores_operational_keys_only():
    a = TrainConfig(train_file='x')
    same = run_defining(a.replace(mesh_data=2, log_every=3, eval_batch_size=8))
    assert fingerprint(run_defining(a)) == fingerprint(same)
    other = run_defining(a.replace(learning_rate=1e-4))
    assert fingerprint(run_defining(a)) != fingerprint(other)
    assert differences(run_defining(a), other) == {
        'learning_rate': (3e-5, 1e-4)}
    assert parse_key_list('max_steps, num_epochs') == ('max_steps', 'num_epochs')
    with pytest.raises(ConfigError, match="unknown config key 'max_step'"):
        parse_key_list('max_step')


def _reference_schedule(cfg, examples):
    """HF Trainer (SimCSE's): ceil(examples / batch) batches an epoch (drop_last=False),
    ceil(epochs x batches) steps, evaluation at every multiple of eval_steps only."""
    it = BatchIterator({'x': np.zeros((examples, 1), np.int8)}, cfg.batch_size,
                       last_batch=cfg.last_batch, granularity=8)
    total = cfg.max_steps or math.ceil(cfg.num_epochs * it.steps_per_epoch)
    evals = [s for s in range(1, total + 1) if s % cfg.eval_every == 0]
    if cfg.eval_at_end and total not in evals:
        evals.append(total)
    return it.steps_per_epoch, total, ([0] if cfg.eval_at_start else []) + evals


def test_paper_configs_count_steps_and_evaluations_as_the_reference():
    sup = TrainConfig.from_dict(load_config_file(str(REPO / 'configs' /
                                                                'sup_simcse_bert_base.py')))
    # nli_for_simcse.csv: 275,601 triplets; 538 full batches of 512 + one of 145 (-> 144 on
    # 8 batch shards).
    per_epoch, total, evals = _reference_schedule(sup, 275_601)
    assert (per_epoch, total) == (539, 1617)
    assert evals == list(range(125, 1501, 125))  # no step 0, no final step 1617
    assert (sup.grad_reduction, sup.grad_replicas, sup.batch_size) == ('replica_mean', 4, 512)
    assert (sup.learning_rate, sup.max_len, sup.pooler, sup.mlp_only_train) == (
        5e-5, 32, 'cls', False)
    unsup = TrainConfig.from_dict(load_config_file(str(REPO / 'configs' /
                                                                  'unsup_simcse_bert_base.py')))
    per_epoch, total, evals = _reference_schedule(unsup, 1_000_000)  # wiki1m: 15,625 x 64
    assert (per_epoch, total, evals[0], evals[-1]) == (15625, 15625, 125, 15625)
    assert (unsup.grad_reduction, unsup.batch_size, unsup.learning_rate) == (
        'global_mean', 64, 3e-5)
    assert unsup.mlp_only_train and unsup.last_batch == 'keep'
