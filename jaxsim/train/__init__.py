"""SimCSE-style contrastive training of a SentenceEncoder.

  config.py  TrainConfig (typed, validated; imports no JAX), config files and overrides
  build.py   the encoder, its initial parameters and the training examples from a config
  optim.py   learning-rate schedule and optimizer
  state.py   TrainState and its shardings
  step.py    the jitted, sharded train step (any registered objective)
  records.py the run record in a workdir: fingerprint, allowed changes, metrics, result
  loop.py    train_and_evaluate, run_seeds

This package file imports nothing, so `jaxsim.train.config` loads without the training stack.
"""
