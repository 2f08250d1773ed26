"""STS-B evaluation inside training: the model-selection metric and the final test score.

The encoder is run by `jaxsim.encode` (the one encode path) on the training mesh with the
training state's parameters, and scored by `jaxsim.eval.metrics.spearman_x100` (Spearman x100 of
the cosine), as SimCSE's trainer scores STS-B dev.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
from jax.sharding import Mesh

from jaxsim.data.senteval import StsPairs, load_stsb
from jaxsim.encode import encode
from jaxsim.errors import ConfigError
from jaxsim.eval.metrics import spearman_x100
from jaxsim.model import SentenceModel

DEV_METRIC = 'stsb_dev'
TEST_METRIC = 'stsb_test'


class StsbEvaluator:
    """Scores parameters on STS-B dev (and test).

    Args:
      model: the model being trained (module, tokenizer); its params are passed per call.
      mesh: the training mesh (the batch is split over its data axes).
      root: the SentEval data folder.
      max_length, batch_size: encoding settings.
      test: also load the test split.
    """

    def __init__(self, model: SentenceModel, mesh: Mesh, root: str, max_length: int,
                 batch_size: int, test: bool):
        if not 2 <= max_length <= model.config.max_length:
            # Checked here, before the run writes its workdir, not at the first evaluation.
            raise ConfigError(f'train config: eval_max_len must be in [2, '
                              f'{model.config.max_length}] for this model, got {max_length}')
        self.model, self.mesh = model, mesh
        self.max_length, self.batch_size = max_length, batch_size
        self.pairs = {'dev': load_stsb(root, 'dev')}
        if test:
            self.pairs['test'] = load_stsb(root, 'test')

    def score(self, params: Any, split: str = 'dev') -> float:
        """Spearman x100 of cosine vs gold; every unique sentence is encoded once."""
        pairs: StsPairs = self.pairs[split]
        unique = sorted(set(pairs.sent1) | set(pairs.sent2))
        vectors = encode(self.model, unique, params=params, mesh=self.mesh,
                         batch_size=self.batch_size, max_length=self.max_length)
        row = {s: i for i, s in enumerate(unique)}
        e1 = vectors[[row[s] for s in pairs.sent1]]
        e2 = vectors[[row[s] for s in pairs.sent2]]
        return float(spearman_x100(e1, e2, np.asarray(pairs.gold)))

    def has(self, split: str) -> bool:
        return split in self.pairs


def optional_evaluator(model: SentenceModel, mesh: Mesh, root: str, max_length: int,
                       batch_size: int, test: bool) -> Optional[StsbEvaluator]:
    return StsbEvaluator(model, mesh, root, max_length, batch_size, test) if root else None
