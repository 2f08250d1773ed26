"""SimCSE-style contrastive training of a SentenceEncoder.

  config.py        TrainConfig (typed, validated, its defaults; imports no JAX)
  config_files.py  config files (`path.py[:arg]`) and `key=value` overrides (no JAX)
  fingerprint.py   what makes two configs the same run (no JAX)
  build.py         the encoder, its initial parameters and the training examples from a config
  optim.py         learning-rate schedule and optimizer
  state.py         TrainState and its shardings
  step.py          the jitted, sharded train step (any registered objective)
  records.py       the run record in a workdir: fingerprint, allowed changes, metrics, result
  loop.py          train_and_evaluate, run_seeds

This package file imports nothing, so the three config modules load without the training stack.
"""
