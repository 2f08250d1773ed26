"""Supervised SimCSE on SNLI with and without `mask_duplicates`: the duplicate-premise spikes.

SNLI repeats premises: `build_snli_triplets` pairs each entailment of a premise with one of its
contradictions, so a premise with two entailments gives two triplets, and a batch may hold both.
Row i's softmax then counts the other copy's entailment (a true paraphrase of its premise) as a
negative, and that step's loss spikes. `mask_duplicates=True` leaves such false negatives out.

The two runs share everything else (seed, data order, model), so their steps see the same
batches. For each run the record holds every step's loss, the median, the steps whose loss is
above `--factor` x the median (spikes), and which steps' batches repeat a premise.

    python benchmarks/duplicate_premises.py [--model bundled] [--steps 20] [--batch-size 64]
        [--json out.json]

`--csv FILE` trains on a CSV of (sent0, sent1, hard_neg) rows instead of SentEval's SNLI;
`--sample` on a sample of SNLI dev's own triplets, 8 premises twice and 16 once (32 triplets),
so that batches of 8 often hold a premise twice; `--random-init` with `--model bundled` trains
a tiny random-init BERT; `--skip N` leaves the first N steps out of the statistics (a random
model's first steps, before it fits the data, are large for reasons that have nothing to do
with duplicates). The test's setting (tests/benchmarks/duplicate_premises_test.py):

    python benchmarks/duplicate_premises.py --sample --random-init --dropout 0 --steps 500 \
        --skip 400 --batch-size 8 --learning-rate 2e-3 --temp 0.02

A model that fits its data drives every other step's loss towards 0, while a batch holding a
premise twice keeps at least 2 ln 2 / batch per repeated pair (the two rows ask for opposite
orders of the same two entailments): those steps stand out by orders of magnitude, and with
the mask they do not.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(_ROOT))

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64)


def train_config(*, model: str, data: Optional[Path], steps: int, batch_size: int,
                 max_len: int, learning_rate: float, temp: float, seed: int, mask: bool,
                 random_init: bool, dropout: float) -> dict:
    """The fields of one run (masked or not): supervised SimCSE, no evaluation."""
    fields = dict(model=model, random_init=random_init, pooler='cls', mlp_only_train=False,
                  objective='sup', objective_kwargs={'temp': temp, 'mask_duplicates': mask},
                  max_len=max_len, batch_size=batch_size, max_steps=steps,
                  learning_rate=learning_rate, warmup_steps=0, seed=seed, senteval_root='',
                  eval_every=0, eval_at_end=False, log_every=1, checkpoint=False,
                  tensorboard=False, dropout=dropout, fast_compile=random_init)
    if random_init:
        fields['model_overrides'] = dict(TINY)
    if data is None:
        from jaxsim.storage.paths import SENTEVAL_ROOT
        fields.update(data_format='snli', train_file=str(SENTEVAL_ROOT / 'SNLI'))
    else:
        fields.update(data_format='csv', train_file=str(data))
    return fields


def write_snli_sample(out: Path, pairs: int = 8, singles: int = 16) -> Path:
    """A CSV of SentEval SNLI dev's triplets: `pairs` premises with two triplets each, then
    `singles` premises with one (the first such, in file order)."""
    from jaxsim.data import sources
    from jaxsim.storage.paths import SENTEVAL_ROOT

    source = sources.SnliSource(SENTEVAL_ROOT / 'SNLI', ('dev',))
    by_premise: dict = {}
    for i in range(len(source)):
        triplet = source[i]
        by_premise.setdefault(triplet[0], []).append(triplet)
    twice = [t[:2] for t in by_premise.values() if len(t) >= 2][:pairs]
    once = [t[0] for t in by_premise.values() if len(t) == 1][:singles]
    with open(out, 'w', newline='', encoding='utf-8') as f:
        writer = csv.writer(f)
        writer.writerow(['sent0', 'sent1', 'hard_neg'])
        writer.writerows([t for pair in twice for t in pair] + once)
    return out


def duplicate_steps(fields: dict) -> list[int]:
    """The steps (1-based) whose batch repeats a premise, read from the run's own batches."""
    from jaxsim import sharding
    from jaxsim.formats.hf_folder import bundled_model_path, load_tokenizer, resolve_model_path
    from jaxsim.train import build
    from jaxsim.train.config import TrainConfig, base_config

    cfg = TrainConfig.from_dict({**base_config().to_dict(), **fields})
    path = bundled_model_path() if cfg.model == 'bundled' else resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(Path(path))
    it = build.train_batches(cfg, build.open_source(cfg), tokenizer, sharding.config_mesh(cfg))
    out = []
    try:
        for step in range(1, cfg.max_steps + 1):
            premises = np.asarray(next(it)['input_ids'])[:, 0]
            if len({row.tobytes() for row in premises}) < len(premises):
                out.append(step)
    finally:
        it.close()
    return out


def summary(losses: list[float], factor: float, skip: int) -> dict:
    window = losses[skip:]
    median = statistics.median(window)
    spikes = [skip + i + 1 for i, x in enumerate(window) if x > factor * median]
    return {'median': median, 'max': max(window), 'max_over_median': max(window) / median,
            'spikes': spikes}


def run(*, model: str = 'bundled', data: Optional[Path] = None, steps: int = 20,
        batch_size: int = 64, max_len: int = 32, learning_rate: float = 5e-5,
        temp: float = 0.05, seed: int = 42, random_init: bool = False, dropout: float = -1.0,
        factor: float = 10.0, skip: int = 0, workdir: Optional[Path] = None) -> dict:
    """Both runs; the record (see the module docstring)."""
    from jaxsim.train import loop
    from jaxsim.train.step import configure_jax

    configure_jax()
    common = dict(model=model, data=data, steps=steps, batch_size=batch_size, max_len=max_len,
                  learning_rate=learning_rate, temp=temp, seed=seed, random_init=random_init,
                  dropout=dropout)
    record = {'settings': {**common, 'data': str(data) if data else 'SentEval SNLI (dev,test)',
                           'factor': factor, 'skip': skip},
              'duplicate_steps': duplicate_steps(train_config(mask=False, **common))}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(workdir or tmp)
        for name, mask in (('unmasked', False), ('masked', True)):
            fields = train_config(mask=mask, **common)
            loop.train_and_evaluate(fields, root / name, progress=False)
            rows = [json.loads(x) for x in (root / name / 'metrics.jsonl').read_text().splitlines()]
            losses = [r['loss'] for r in rows if 'loss' in r]
            record[name] = {'losses': losses, **summary(losses, factor, skip)}
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='bundled', help='base model (default: bundled MiniLM)')
    p.add_argument('--csv', type=Path, default=None,
                   help='train on this CSV (sent0,sent1,hard_neg) instead of SentEval SNLI')
    p.add_argument('--sample', action='store_true',
                   help='train on 32 SNLI dev triplets, 8 premises of them twice')
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--batch-size', type=int, default=64)
    p.add_argument('--max-len', type=int, default=32)
    p.add_argument('--learning-rate', type=float, default=5e-5)
    p.add_argument('--temp', type=float, default=0.05)
    p.add_argument('--seed', type=int, default=42)
    p.add_argument('--random-init', action='store_true',
                   help='a tiny random-init BERT with the model\'s tokenizer')
    p.add_argument('--dropout', type=float, default=-1.0,
                   help='dropout (negative: the base model\'s)')
    p.add_argument('--factor', type=float, default=10.0, help='a spike: loss > FACTOR x median')
    p.add_argument('--skip', type=int, default=0, help='leave the first N steps out of the '
                   'statistics')
    p.add_argument('--json', type=Path, default=None, help='write the record here')
    a = p.parse_args(argv)
    if a.sample and a.csv:
        p.error('--sample and --csv: choose one')
    tmp = tempfile.TemporaryDirectory()
    data = write_snli_sample(Path(tmp.name) / 'snli_sample.csv') if a.sample else a.csv
    record = run(model=a.model, data=data, steps=a.steps, batch_size=a.batch_size,
                 max_len=a.max_len, learning_rate=a.learning_rate, temp=a.temp, seed=a.seed,
                 random_init=a.random_init, dropout=a.dropout, factor=a.factor, skip=a.skip)
    print(f"steps whose batch repeats a premise: {record['duplicate_steps']}")
    for name in ('unmasked', 'masked'):
        r = record[name]
        print(f"{name:9s} median {r['median']:.3g}  max {r['max']:.3g} "
              f"({r['max_over_median']:.1f}x median)  steps above {a.factor:g}x median: "
              f"{r['spikes']}")
    if a.sample:
        record['settings']['data'] = 'SNLI dev sample: 8 premises twice, 16 once'
    if a.json:
        a.json.write_text(json.dumps(record, indent=2) + '\n')
    tmp.cleanup()
    return 0


if __name__ == '__main__':
    sys.exit(main())
