"""The frequency table before and after calibrations, with sentence-level diagnostics beside.

A calibration (whitening, a flow, ...) is fitted on SENTENCE vectors: here the vectors of the
corpus sentences, fitted as `eval.py --post` fits it. It is a row-wise map of the embedding
space, so it can also be applied to the STATIC token embeddings (the word-piece table) when
they live in the same space (same size: no projection head). The question it answers is
BERT-flow's: does the calibration undo the frequency bias (rare tokens far from the origin
and sparse, frequent ones near it and dense)?

`analyze_model` runs the whole analysis of a loaded model (`python -m jaxsim analyze`).

Beside each table, the diagnostics of the sentence vectors themselves before and after:
anisotropy (mean cosine over all pairs of distinct sentences, `diagnostics.mean_random_cosine`),
the singular-value spectrum, its top direction's share of the energy and its effective rank
(Roy & Vetterli 2007: exp of the entropy of the normalized singular values; D for a flat
spectrum, 1 for a single direction).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxsim import calibrate
from jaxsim.analysis.frequency import (
    PAPER_BUCKETS,
    count_tokens,
    frequency_table,
    rank_tokens,
    saved_figure,
    token_embeddings,
)
from jaxsim.errors import JaxsimError
from jaxsim.eval import diagnostics, runner

FitFn = Callable[..., calibrate.Calibration]


class CalibratedAnalysisError(JaxsimError):
    """A calibration that cannot be applied to the token embeddings."""


def effective_rank(singular_values: Sequence[float]) -> float:
    """exp(entropy of s / sum(s)) (Roy & Vetterli 2007); 0 for an all-zero spectrum."""
    s = np.asarray(singular_values, np.float64)
    s = s[s > 0]
    if not s.size:
        return 0.0
    p = s / s.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def sentence_diagnostics(x: np.ndarray) -> dict:
    """Anisotropy and spectrum of sentence vectors [N, D] (rows must be non-zero)."""
    s = diagnostics.singular_values(x)
    return {'anisotropy': diagnostics.mean_random_cosine(x),
            'effective_rank': effective_rank(s),
            'top1_energy': float(s[0] ** 2 / (s ** 2).sum()),
            'dim': int(x.shape[1]),
            'singular_values': [float(v) for v in s]}


def _state(tokens: np.ndarray, sentences: np.ndarray, buckets: Sequence[int], k: int) -> dict:
    """Frequency table of `tokens` (rank order) and diagnostics of `sentences`."""
    table = frequency_table(tokens, np.arange(len(tokens)), buckets, k)
    return {'buckets': [dataclasses.asdict(b) for b in table],
            'token_anisotropy': diagnostics.mean_random_cosine(tokens),
            'sentence_diagnostics': sentence_diagnostics(sentences)}


def tb_folder(root: Optional[str], post: str) -> Optional[str]:
    """A TensorBoard folder per calibration: ROOT/<spec with odd characters as '_'>."""
    if not root:
        return None
    return os.path.join(root, re.sub(r'[^A-Za-z0-9_.-]+', '_', post))


def analyze_calibrations(embeddings: np.ndarray, ranked: np.ndarray, sentences: np.ndarray,
                         posts: Sequence[str], *, buckets: Sequence[int] = PAPER_BUCKETS,
                         k: int = 3, fit: FitFn = calibrate.fit,
                         options: Optional[dict] = None, tb_dir: Optional[str] = None) -> dict:
    """The frequency table and sentence diagnostics, raw and after each calibration.

    Each of `posts` (specs as `eval.py --post` takes them) is fitted on the [N, D] `sentences`
    by `fit(spec, x, **options)` and applied to the [vocab, D] token `embeddings` in `ranked`
    order; a fit that reports (flows) writes to `tb_dir`/<spec>. Returns {'raw': state,
    'calibrations': [{'post', 'calibration', 'note', **state}, ...]}, a state being
    {'buckets', 'token_anisotropy', 'sentence_diagnostics'}.
    """
    tokens = np.asarray(embeddings, np.float32)[np.asarray(ranked)]
    sentences = np.asarray(sentences, np.float32)
    if tokens.shape[1] != sentences.shape[1]:
        raise CalibratedAnalysisError(
            f'--post: calibrations are fitted on the {sentences.shape[1]}-dim sentence vectors '
            f'and cannot map the {tokens.shape[1]}-dim token embeddings (the model has a '
            f'projection head); analyze without --post')
    out = {'raw': _state(tokens, sentences, buckets, k), 'calibrations': []}
    for post in posts:
        opts = dict(options or {})
        folder = tb_folder(tb_dir, post)
        if folder is not None:
            opts['tb_dir'] = folder
        cal = fit(post, sentences, **opts)
        after = _state(np.asarray(cal.apply(tokens), np.float32),
                       np.asarray(cal.apply(sentences), np.float32), buckets, k)
        out['calibrations'].append({'post': cal.spec or post, 'calibration': cal.describe(),
                                    'note': cal.note, **after})
    return out


def plot_spectra(result: dict, path: str | os.PathLike) -> pathlib.Path:
    """The sentence vectors' singular values (divided by the largest), raw and calibrated."""
    with saved_figure(path, figsize=(6, 4)) as (_, ax):
        for name, state in [('raw', result)] + [(c['post'], c) for c in result['calibrations']]:
            d = state['sentence_diagnostics']
            s = np.asarray(d['singular_values'])
            ax.semilogy(np.arange(1, len(s) + 1), s / s[0],
                        label=f"{name}: anisotropy {d['anisotropy']:.3f}, "
                              f"eff. rank {d['effective_rank']:.0f}")
        ax.set_xlabel('direction')
        ax.set_ylabel('singular value / largest')
        ax.set_title('Sentence vectors of the corpus')
        ax.legend(fontsize=8)
    return pathlib.Path(path)


def analyze_model(model: Any, sentences: Sequence[str], unique: Sequence[str],
                  posts: Sequence[str], buckets: Sequence[int], k: int, tb: str | None) -> dict:
    """The analysis of a loaded model: counts on `sentences`, calibrations and diagnostics on
    the vectors of the `unique` sentences (encoded, and for flows noised, as eval.py does)."""
    t0 = time.perf_counter()
    counts = count_tokens(model.tokenizer, sentences)
    ranked = rank_tokens(counts)
    vectors = runner.make_encoder(model)(unique)
    encode_s = time.perf_counter() - t0
    noisy = runner.make_noisy_encoder(model)
    # eval.py's fit options: seed 0; flows fit on dropout-noised vectors of the same sentences.
    options = {"seed": 0, "embed": lambda key: noisy(list(unique), key)}
    post = analyze_calibrations(
        token_embeddings(model), ranked, vectors, posts, buckets=buckets, k=k,
        options=options, tb_dir=tb)
    return {"model": str(model.path), "sentences": len(sentences),
            "unique_sentences": len(unique), "tokens_counted": int(counts.sum()),
            "tokens_ranked": int(len(ranked)), "k": k, **post["raw"],
            "most_frequent": model.tokenizer.convert_ids_to_tokens(ranked[:20].tolist()),
            "calibrations": post["calibrations"],
            "timing": {"encode_s": round(encode_s, 2),
                       "total_s": round(time.perf_counter() - t0, 2)}}
