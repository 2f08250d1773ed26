"""PNG figures of the diagnostics: spectra before/after calibration, alignment vs uniformity."""
from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import numpy as np

from jaxsim.eval.protocol import StsResult


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')  # Headless: never needs a display.
    import matplotlib.pyplot as plt
    return plt


def _name(r: StsResult, multi_model: bool) -> str:
    return f'{r.model}: {r.label}' if multi_model else r.label


def plot_spectra(results: Sequence[StsResult], path: str | os.PathLike) -> pathlib.Path:
    """Normalized singular values (s_i / s_1, log scale) of each row's embedding matrix."""
    plt = _pyplot()
    multi = len({r.model for r in results}) > 1
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        s = np.asarray(r.details['diagnostics']['singular_values'])
        # Floor exact zeros (dead dims) so the log axis stays finite.
        ax.semilogy(np.arange(1, s.size + 1), np.maximum(s / s[0], 1e-12), label=_name(r, multi))
    ax.set_xlabel('index')
    ax.set_ylabel('singular value / largest')
    ax.set_title('Spectrum of the sentence embeddings')
    ax.legend()
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_align_uniform(results: Sequence[StsResult], path: str | os.PathLike) -> pathlib.Path:
    """Alignment (x) vs uniformity (y), lower is better for both (SimCSE Fig. 2)."""
    plt = _pyplot()
    multi = len({r.model for r in results}) > 1
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in results:
        d = r.details['diagnostics']
        ax.scatter(d['alignment'], d['uniformity'])
        ax.annotate(_name(r, multi), (d['alignment'], d['uniformity']),
                    textcoords='offset points', xytext=(4, 4), fontsize=8)
    ax.set_xlabel('alignment (lower is better)')
    ax.set_ylabel('uniformity (lower is better)')
    ax.set_title('Alignment vs uniformity (STS-B)')
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(results: Sequence[StsResult], directory: str | os.PathLike) -> list[pathlib.Path]:
    """Writes the figures the diagnostics allow; returns their paths."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with_diag = [r for r in results if 'diagnostics' in r.details]
    if not with_diag:
        raise ValueError('--plots needs diagnostics, which were not computed')
    out = [plot_spectra(with_diag, directory / 'spectrum.png')]
    with_au = [r for r in with_diag if 'alignment' in r.details['diagnostics']
               and 'uniformity' in r.details['diagnostics']]
    if with_au:
        out.append(plot_align_uniform(with_au, directory / 'align_uniform.png'))
    return out
