"""SentenceModel: a ready-to-use sentence encoder (module, parameters, tokenizer).

What `jaxsim.load_pretrained` returns for a Hugging Face folder, a hub id or a train workdir,
and what `encode`, evaluation, search and export take. It holds no I/O: loading lives in
`jaxsim.formats` (`jaxsim.formats.pretrained`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, check_params


@dataclasses.dataclass(frozen=True)
class SentenceModel:
    """A sentence encoder and its weights.

    Attributes:
      encoder: the `SentenceEncoder` module (architecture + pooler).
      params: its parameter tree ({'bert': ..., 'pooler': ...}). A checkpoint's own pooler
        weights ride along under 'pooler' even when the chosen pooler does not use them, so
        `with_pooler('cls')` works on any model that shipped them.
      tokenizer: a `transformers` fast tokenizer.
      path: where it was loaded from (folder, hub id or workdir).
      max_seq_length: the token limit it was trained/published with, or None for the
        tokenizer's limit.
      ignored: checkpoint tensors that were not loaded (task heads, buffers).
      head: modules applied after pooling (`jaxsim.models.st_head`: a sentence-transformers
        folder's Dense / Normalize), by `jaxsim.encode`.
    """

    encoder: SentenceEncoder
    params: Any
    tokenizer: Any
    path: str = ""
    max_seq_length: Optional[int] = None
    ignored: tuple[str, ...] = ()
    head: tuple = ()

    @property
    def config(self) -> BertConfig:
        return self.encoder.config

    @property
    def pooler(self) -> str:
        return self.encoder.pooler

    @property
    def hidden_size(self) -> int:
        return self.encoder.config.hidden_size

    @property
    def has_pooler_weights(self) -> bool:
        return "pooler" in self.params

    def with_pooler(self, name: str) -> "SentenceModel":
        """The same weights under another pooler; an error when it needs weights not here."""
        if name == self.encoder.pooler:
            return self
        # mlp_only_train only concerns the pooler it was trained with.
        encoder = self.encoder.clone(pooler=name, mlp_only_train=False)
        check_params(encoder, self.params, self.path or "model")
        return dataclasses.replace(self, encoder=encoder)

    def with_params(self, params: Any) -> "SentenceModel":
        return dataclasses.replace(self, params=params)

    def max_length(self) -> int:
        """Token limit: the published one, else the tokenizer's, capped by the position table."""
        limit = (self.max_seq_length or getattr(self.tokenizer, "model_max_length", None)
                 or self.config.max_length)
        return int(min(limit, self.config.max_length))
