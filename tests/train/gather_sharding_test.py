"""Tensor-sharded train steps compile as sharded programs: XLA reports no "Involuntary full
rematerialization" (an operand gathered whole onto every device because its sharding could
not be kept), in particular for the word-embedding gather and the tied masked-LM head when the
vocabulary is split over 'tensor'. XLA prints that warning on stderr at compile time, so each
mesh's step is compiled in a subprocess whose stderr is read."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent('''
    import sys
    import jax, numpy as np
    from jaxsim import sharding
    from jaxsim.models.bert import BertConfig
    from jaxsim.models.encoder import SentenceEncoder
    from jaxsim.objectives import get_objective
    from jaxsim.objectives.mlm import MlmSettings
    from jaxsim.train.config import TrainConfig
    from jaxsim.train.optim import make_optimizer
    from jaxsim.train.state import abstract_state, state_shape, state_shardings
    from jaxsim.train.step import (CompileTarget, LossSpec, UpdateSpec, batch_shardings,
                                   configure_jax, make_train_step)
    configure_jax()
    mesh = sharding.make_mesh(*map(int, sys.argv[1].split(',')))
    # BERT's vocabulary (30522 = 2 x 15261): split over a tensor axis of 2.
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=64)
    encoder = SentenceEncoder(config, pooler='cls', mlp_only_train=True, mlm=True)
    tx = make_optimizer(TrainConfig(train_file='x', optimizer='sgd'), 3)
    shape = state_shape(encoder, tx, jax.random.key(1))
    shardings = state_shardings(shape, mesh)
    spec = shardings.params['bert']['embeddings']['word_embeddings']['embedding'].spec
    mlm = MlmSettings(weight=0.1, probability=0.15, mask_id=103, vocab_size=30522,
                      special_ids=(0, 101, 102))
    step = make_train_step(
        loss=LossSpec(encoder=encoder, objective=get_objective('unsup').loss, views=2, mlm=mlm),
        update=UpdateSpec(tx=tx), target=CompileTarget(mesh=mesh, state_shardings=shardings))
    ids = {k: jax.ShapeDtypeStruct((16, 1, 12), np.int32, sharding=s)
           for k, s in batch_shardings(mesh).items()}
    step.lower(abstract_state(shape, shardings), ids).compile()
    print('SPEC', spec, flush=True)
''')


@pytest.mark.parametrize('mesh, spec', [('4,1,2', "P('tensor',)"),
                                        ('2,2,2', "P('tensor', 'fsdp')")])
def test_tensor_sharded_step_compiles_without_involuntary_rematerialization(mesh, spec):
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO),
               XLA_FLAGS='--xla_force_host_platform_device_count=8')
    env.pop('TF_CPP_MIN_LOG_LEVEL', None)  # XLA's warnings on
    p = subprocess.run([sys.executable, '-c', _SCRIPT, mesh], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f'SPEC {spec}' in p.stdout  # the vocabulary really is split
    assert 'Involuntary full rematerialization' not in p.stderr, p.stderr[-3000:]
