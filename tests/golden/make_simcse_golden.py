"""Writes tests/golden/simcse_golden.npz: SimCSE's own evaluation-time encoder, executed.

Runs princeton-nlp/SimCSE's `simcse/models.py` (imported from a checkout; nothing of it is
copied here) on the bundled all-MiniLM-L6-v2: `BertForCL.forward(sent_emb=True)`, i.e.
`sentemb_forward` and its `Pooler`, for every pooler with `mlp_only_train` on and off, on 20
STS-B test sentences. The checkout's `MLPLayer` (the 'cls' head) is loaded with the model's
`pooler.dense` weights, which is where a SimCSE checkpoint converted to Hugging Face format
stores it (and where jaxsim reads the 'cls' head from).

Not run in CI (needs torch and the checkout). Regenerate with, from the repository root:

  git clone https://github.com/princeton-nlp/SimCSE /tmp/SimCSE
  git -C /tmp/SimCSE checkout 49fa580a853752ede55b8c76d9debf748e214d3f
  PYTHONPATH=$PWD python tests/golden/make_simcse_golden.py /tmp/SimCSE

(torch 2.13.0 and transformers as in the test extra of pyproject.toml).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import pathlib
import subprocess
import sys
import types

import numpy as np

import jaxsim
from jaxsim.storage.paths import SENTEVAL_ROOT

SIMCSE_COMMIT = '49fa580a853752ede55b8c76d9debf748e214d3f'
POOLERS = ('cls', 'cls_before_pooler', 'avg', 'avg_top2', 'avg_first_last')
HERE = pathlib.Path(__file__).resolve().parent
STSB_TEST = SENTEVAL_ROOT / 'STS' / 'STSBenchmark' / 'sts-test.csv'
MAX_LENGTH = 128


def stsb_sentences(path: pathlib.Path, pairs: int = 10, stride: int = 137) -> list[str]:
    """Both sentences of `pairs` STS-B test pairs spread over the file (all genres)."""
    with open(path, encoding='utf-8') as f:
        rows = list(csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE))
    out = []
    for row in rows[::stride][:pairs]:
        out.extend([row[5], row[6]])
    return out


def load_models_module(checkout: pathlib.Path) -> types.ModuleType:
    """simcse/models.py by file path: the package's __init__ pulls in its tool (faiss etc.)."""
    path = checkout / 'simcse' / 'models.py'
    spec = importlib.util.spec_from_file_location('simcse_models', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkout_commit(checkout: pathlib.Path) -> str:
    try:
        return subprocess.run(['git', '-C', str(checkout), 'rev-parse', 'HEAD'], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def load_bert_for_cl(bert_for_cl, config, weights: dict, model_args):
    """The checkout's BertForCL holding the checkpoint's weights, in eval mode.

    BertForCL's init (written for transformers 4) calls `init_weights()` where transformers 5
    expects `post_init()` (which records the tied-weight keys `init_weights` reads), so a
    subclass routes the first call through `post_init`; nothing else of the class changes.
    The weights are filled with `load_state_dict`; the 'cls' head (`mlp.dense`) takes
    `pooler.dense`.
    """
    import torch

    class BertForCLOnTransformers5(bert_for_cl):
        def init_weights(self):
            if not hasattr(self, 'all_tied_weights_keys'):
                self.post_init()  # sets the keys, then calls init_weights again
            else:
                super().init_weights()

    model = BertForCLOnTransformers5(config, model_args=model_args)
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    encoder = {k: v for k, v in state.items() if not k.startswith('pooler.')}
    missing, unexpected = model.bert.load_state_dict(encoder, strict=False)
    if missing or set(unexpected) - {'embeddings.position_ids'}:
        sys.exit(f'checkpoint does not fit BertForCL.bert: missing {missing}, '
                 f'unexpected {unexpected}')
    if hasattr(model, 'mlp'):
        model.mlp.dense.load_state_dict({'weight': state['pooler.dense.weight'],
                                         'bias': state['pooler.dense.bias']})
    return model.eval()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('checkout', type=pathlib.Path, help='princeton-nlp/SimCSE checkout')
    parser.add_argument('--sts', type=pathlib.Path, default=STSB_TEST, help='sts-test.csv')
    parser.add_argument('--out', type=pathlib.Path, default=HERE / 'simcse_golden.npz')
    args = parser.parse_args(argv)
    commit = checkout_commit(args.checkout)
    if commit not in (SIMCSE_COMMIT, 'unknown'):
        sys.exit(f'{args.checkout} is at {commit}, expected {SIMCSE_COMMIT}')

    import safetensors.numpy
    import torch
    import transformers

    models = load_models_module(args.checkout)
    folder = jaxsim.bundled_model_path()
    weights = safetensors.numpy.load_file(str(folder / 'model.safetensors'))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    sentences = stsb_sentences(args.sts)
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=MAX_LENGTH,
                      return_tensors='pt')

    config = transformers.BertConfig.from_pretrained(str(folder))
    outputs = {}
    for pooler in POOLERS:
        for mlp_only_train in (False, True):
            model_args = types.SimpleNamespace(pooler_type=pooler, temp=0.05, do_mlm=False,
                                               mlp_only_train=mlp_only_train)
            model = load_bert_for_cl(models.BertForCL, config, weights, model_args)
            with torch.no_grad():
                out = model(**batch, sent_emb=True, return_dict=True)
            key = f'{pooler}/mlp_only_train={int(mlp_only_train)}'
            outputs[key] = out.pooler_output.numpy().astype(np.float32)
            print(key, outputs[key].shape, float(np.abs(outputs[key]).mean()))

    np.savez_compressed(
        args.out, sentences=np.array(sentences), max_length=np.int32(MAX_LENGTH),
        input_ids=batch['input_ids'].numpy().astype(np.int32),
        simcse_commit=np.array(SIMCSE_COMMIT), torch_version=np.array(torch.__version__),
        transformers_version=np.array(transformers.__version__), **outputs)
    print(f'wrote {args.out} ({args.out.stat().st_size} bytes)')


if __name__ == '__main__':
    main()
