"""PNG figures of the diagnostics: spectra before/after calibration, alignment vs uniformity."""
from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import numpy as np

from jaxsim.eval.protocol import StsResult
from jaxsim.storage import store


def _figure(results: Sequence[StsResult], figsize: tuple[int, int]):
    """(pyplot, figure, axes, the rows' legend names: the model too when there are several)."""
    import matplotlib
    matplotlib.use('Agg')  # Headless: never needs a display.
    import matplotlib.pyplot as plt
    multi = len({r.model for r in results}) > 1
    fig, ax = plt.subplots(figsize=figsize)
    return plt, fig, ax, [f'{r.model}: {r.label}' if multi else r.label for r in results]


def _save(plt, fig, path: str | os.PathLike) -> pathlib.Path:
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_spectra(results: Sequence[StsResult], path: str | os.PathLike) -> pathlib.Path:
    """Normalized singular values (s_i / s_1, log scale) of each row's embedding matrix."""
    plt, fig, ax, names = _figure(results, (6, 4))
    for r, name in zip(results, names):
        s = np.asarray(r.details['diagnostics']['singular_values'])
        # Floor exact zeros (dead dims) so the log axis stays finite.
        ax.semilogy(np.arange(1, s.size + 1), np.maximum(s / s[0], 1e-12), label=name)
    ax.set_xlabel('index')
    ax.set_ylabel('singular value / largest')
    ax.set_title('Spectrum of the sentence embeddings')
    ax.legend()
    return _save(plt, fig, path)


def plot_align_uniform(results: Sequence[StsResult], path: str | os.PathLike) -> pathlib.Path:
    """Alignment (x) vs uniformity (y), lower is better for both (SimCSE Fig. 2)."""
    plt, fig, ax, names = _figure(results, (5, 4))
    for r, name in zip(results, names):
        d = r.details['diagnostics']
        ax.scatter(d['alignment'], d['uniformity'])
        ax.annotate(name, (d['alignment'], d['uniformity']), textcoords='offset points',
                    xytext=(4, 4), fontsize=8)
    ax.set_xlabel('alignment (lower is better)')
    ax.set_ylabel('uniformity (lower is better)')
    ax.set_title('Alignment vs uniformity (STS-B)')
    return _save(plt, fig, path)


PLOT_FILES = ('spectrum.png', 'align_uniform.png')


def check_replaceable(directory) -> None:
    """An existing non-empty folder --overwrite may replace: one holding only our figures."""
    others = [p.name for p in directory.iterdir() if p.name not in PLOT_FILES]
    if others:
        raise ValueError(f'--plots {directory} holds other files ({", ".join(sorted(others)[:3])}'
                         f'); it is not replaced even with --overwrite: choose another folder')


def write_plots(results: Sequence[StsResult], directory: str | os.PathLike,
                overwrite: bool = False) -> list[pathlib.Path]:
    """Writes the figures the diagnostics allow into `directory`, swapped in whole
    (`jaxsim.storage.store.replace_dir`); returns their paths.

    Args:
      overwrite: replace an earlier plots folder (one holding only these figures).
    """
    with_diag = [r for r in results if 'diagnostics' in r.details]
    if not with_diag:
        raise ValueError('--plots needs diagnostics, which were not computed')
    with_au = [r for r in with_diag
               if {'alignment', 'uniformity'} <= r.details['diagnostics'].keys()]
    names = []
    with store.replace_dir(directory, overwrite, '--plots', keep=check_replaceable) as tmp:
        names.append(plot_spectra(with_diag, tmp / PLOT_FILES[0]).name)
        if with_au:
            names.append(plot_align_uniform(with_au, tmp / PLOT_FILES[1]).name)
    return [pathlib.Path(directory) / n for n in names]
