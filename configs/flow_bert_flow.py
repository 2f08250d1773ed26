"""BERT-flow as bohanli/BERT-flow's code executes it (`run_siamese.py --flow=1 --flow_loss=1`).

Read from run_siamese.py, optimization_bert_flow.py and flow/ (glow_1x1.py, glow_ops_1x1.py,
glow_init_hook.py, config/config_l3_d3_w32.json, the `--flow_model_config` default):

- Glow on a 1x1 image with D channels, 3 levels x depth 3; after levels 0 and 1 the second
  half of the channels is factored out to N(0, I); z = [split 0, split 1, top].
- Step = actnorm -> invertible 1x1 -> coupling. "permutation": true makes the 1x1 a fixed,
  non-trainable channel reversal (logdet 0).
- actnorm is (x + b) * exp(3 logs). Its data-dependent init op is built but never run
  (`GlowInitHook` is not passed to the Estimator), so b and logs keep `tf.get_variable`'s
  default glorot-uniform draw: U(+-sqrt(6 / (1 + C))) for their (1, 1, 1, C) shape.
- Additive coupling (z2 = x2 + NN(x1)), NN of width 32: twice [1x1 conv without bias, N(0,
  0.05) -> actnorm (same TF-default init) -> ReLU], then a zero 1x1 conv with zero bias and
  output scale exp(3 logs), logs = 0.
- Loss: bits/dim, the mean over each side of 32 pairs summed (2x the mean over the 64
  sentences); its own AdamWeightDecay optimizer: lr 1e-3 constant, beta 0.9/0.999, eps 1e-6,
  no bias correction, weight decay 0.01 on every flow variable (the exclusion regexes
  LayerNorm/layer_norm/bias match none of b, logs, W), global-norm clipping at 1.0.
- One epoch, no held-out split, no early stopping. The encoder stays frozen but in train mode,
  so the flow sees dropout-noised vectors: configs/flow_bert_flow_dropout.py fits that way, and
  is what plain `flow` fits when the encoder is at hand. This config (`flow:bert_flow`) fits
  the clean vectors it calibrates.
"""
from jaxsim.flows.config import FlowConfig, layer


def get_config() -> FlowConfig:
    return FlowConfig(
        name='bert_flow',
        levels=3,
        depth=3,
        step=(
            layer('actnorm', initialization='tf_default', logscale_factor=3.0, bias='input'),
            layer('reverse'),
            layer('additive_coupling', width=32, hidden_layers=2, net='glow'),
        ),
        data_init=False,
        objective='bits_per_dim',
        loss_scale=2.0,
        optimizer='bert_adamw',
        learning_rate=1e-3,
        weight_decay=0.01,
        weight_decay_exclude=(),
        adam_eps=1e-6,
        clip_norm=1.0,
        batch_size=64,
        max_epochs=1,
        val_fraction=0.0,
        dropout_noise=False,
    )
