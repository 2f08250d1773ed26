"""The papers' encoders known by name, from their public `config.json` values.

Planning a run (`python -m jaxsim plan`) needs only a model's shapes, and a machine planning a
pod run may have neither the weights nor a hub connection: these names give the architecture
without reading any file. Training still loads the weights from a folder or the hub.
"""
from __future__ import annotations

from typing import Optional

from jaxsim.models.bert import BertConfig

_BERT = dict(model_type='bert', vocab_size=30522, max_position_embeddings=512,
             type_vocab_size=2, pad_token_id=0, layer_norm_eps=1e-12)
_ROBERTA = dict(model_type='roberta', vocab_size=50265, max_position_embeddings=514,
                type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5)
_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072)
_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
              intermediate_size=4096)

ARCHITECTURES: dict[str, BertConfig] = {
    'bert-base-uncased': BertConfig(**_BERT, **_BASE),
    'bert-base-cased': BertConfig(**{**_BERT, 'vocab_size': 28996}, **_BASE),
    'bert-large-uncased': BertConfig(**_BERT, **_LARGE),
    'bert-large-cased': BertConfig(**{**_BERT, 'vocab_size': 28996}, **_LARGE),
    'roberta-base': BertConfig(**_ROBERTA, **_BASE),
    'roberta-large': BertConfig(**_ROBERTA, **_LARGE),
}

# The [MASK] id and special-token ids of each family's tokenizer (the masked-LM term's
# settings when no tokenizer is read).
MASK_TOKENS: dict[str, tuple[int, tuple[int, ...]]] = {
    'bert': (103, (0, 100, 101, 102, 103)),
    'roberta': (50264, (0, 1, 2, 3, 50264)),
}


def known_architecture(name: str) -> Optional[BertConfig]:
    """The architecture of a known model name (with or without a hub owner prefix such as
    'google-bert/' or 'FacebookAI/'), or None."""
    return ARCHITECTURES.get(name.rsplit('/', 1)[-1])
