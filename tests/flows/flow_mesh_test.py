"""The flow fit's batch is split over a mesh: with 8 devices the fitted flow equals the
1-device fit up to float32 rounding. Runs in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 set before JAX starts."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np

from tests.conftest import run_on_cpu_devices

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import jax
    import numpy as np
    from jaxsim import calibrate, sharding
    from jaxsim.flows import FlowConfig, FlowError, fit_flow, layer
    from jaxsim.flows.training import default_mesh

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((700, 16)) @ rng.standard_normal((16, 16)) * 0.3).astype('float32')
    x[:, 5] = 0.25  # a constant column, as real sentence vectors have
    out = {}
    configs = {
        # BERT-flow's structure and optimizer (clipping, no bias correction), small widths.
        'bert_flow': FlowConfig(max_epochs=2, step=(
            layer('actnorm', initialization='tf_default', logscale_factor=3.0, bias='input'),
            layer('reverse'), layer('additive_coupling', width=8, net='glow'))),
        # Data-init actnorm, LU, held-out evaluation.
        'glow': FlowConfig(levels=2, depth=2, step=(
            layer('actnorm'), layer('linear_lu'), layer('affine_coupling', width=8)),
            data_init=True, objective='nats', optimizer='adam', loss_scale=1.0,
            weight_decay=0.0, clip_norm=0.0, val_fraction=0.1, evals_per_epoch=2,
            max_epochs=2),
    }
    for name, cfg in configs.items():
        one = fit_flow(x, cfg, jax.random.key(0), mesh=sharding.make_mesh(
            data=1, devices=jax.devices()[:1]))
        eight = fit_flow(x, cfg, jax.random.key(0))  # default: all 8 local devices
        diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                            one.params, eight.params)
        out[name] = {'max_param_diff': max(jax.tree.leaves(diff)),
                     'init_nll': one.init_nll,
                     'nll_one': [h['train_nll'] for h in one.history],
                     'nll_eight': [h['train_nll'] for h in eight.history]}
    cal = calibrate.fit('flow', x, config=configs['bert_flow'])
    out['calibration_dims'] = list(cal.apply(x).shape)
    out['default_mesh'] = dict(default_mesh(64).shape)
    out['default_mesh_12'] = dict(default_mesh(12).shape)
    try:
        fit_flow(x, configs['glow'], jax.random.key(0),
                 mesh=sharding.make_mesh(data=3, devices=jax.devices()[:3]))
        out['indivisible'] = 'no error'
    except FlowError as e:
        out['indivisible'] = str(e)
    print('RESULT' + json.dumps(out), flush=True)
''')


def test_flow_fit_on_8_devices_equals_1_device():
    out = run_on_cpu_devices(_SCRIPT, str(ROOT))
    print(json.dumps(out, indent=1))
    for name in ('bert_flow', 'glow'):
        r = out[name]
        assert r['nll_one'][-1] < r['init_nll'] - 1.0, (name, r)  # the fit really moved
        assert r['max_param_diff'] <= 1e-5, (name, r)
        np.testing.assert_allclose(r['nll_eight'], r['nll_one'], rtol=1e-5)
    assert out['calibration_dims'] == [700, 16]
    assert out['default_mesh'] == {'data': 8, 'fsdp': 1, 'tensor': 1}
    assert out['default_mesh_12'] == {'data': 6, 'fsdp': 1, 'tensor': 1}  # 6 divides 12
    assert 'cannot be split over the 3 batch shards' in out['indivisible']
