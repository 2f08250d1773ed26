"""STS-B evaluation inside training: the model-selection metric and the final test score.

The encoder is run by `jaxsim.encode` (the one encode path) on the training mesh with the
training state's parameters, and scored by the evaluation package's STS-B score
(`jaxsim.eval.runner.stsb_score`: Spearman x100 of the cosine), as SimCSE's trainer scores
STS-B dev.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxsim.data.senteval import load_sts_task
from jaxsim.encode import encode
from jaxsim.errors import ConfigError
from jaxsim.eval.runner import stsb_score
from jaxsim.model import SentenceModel
from jaxsim.models import st_head

DEV_METRIC = 'stsb_dev'


class StsbEvaluator:
    """Scores parameters on STS-B dev (and, with `test`, test) from the SentEval folder `root`,
    encoding with `model` (its params are passed per call) on the training mesh."""

    def __init__(self, model: SentenceModel, mesh: Mesh, root: str, max_length: int,
                 batch_size: int, test: bool):
        if not 2 <= max_length <= model.config.max_length:
            # Checked here, before the run writes its workdir, not at the first evaluation.
            raise ConfigError(f'train config: eval_max_len must be in [2, '
                              f'{model.config.max_length}] for this model, got {max_length}')
        self.model, self.mesh = model, mesh
        self.max_length, self.batch_size = max_length, batch_size
        splits = ('dev', 'test') if test else ('dev',)
        self.tasks = {split: load_sts_task('stsb', root, split) for split in splits}

    def score(self, params: Any, split: str = 'dev') -> float:
        """Spearman x100 of cosine vs gold; every unique sentence is encoded once. `params`:
        the encoder's, with a kept head's Dense weights under 'st_head' (then applied)."""
        params, weights = st_head.split_weights(params)
        model = self.model
        if weights:
            model = dataclasses.replace(model, head=st_head.with_weights(
                model.head, jax.tree.map(np.asarray, weights)))

        def encode_fn(sentences: list[str]):
            return encode(model, sentences, params=params, mesh=self.mesh,
                          batch_size=self.batch_size, max_length=self.max_length)

        return stsb_score(encode_fn, task=self.tasks[split])

    def has(self, split: str) -> bool:
        return split in self.tasks
