"""The papers' models planned for TPU pods: a table of `python -m jaxsim plan` results.

    python benchmarks/pod_plan.py [--models bert-base,bert-large] [--cases unsup-512,sup-4096]
        [--topologies v5e-256,2xv5e-256] [--json PATH] [--markdown PATH] [--search]

Each (model, case, topology) is one `python -m jaxsim plan` process (the command users run,
its JSON read back): whether the step fits a chip's HBM, HBM per chip, the roofline step time
and MFU ceiling, and the mesh to use: the config's own (data-parallel over every chip) when it
fits, else the planned setting that fits (with `--search`, which costs further compiles).
These are the TPU compiler's estimates and the chips' published peaks, not measurements.
A BERT-base plan compiles in minutes on a 2-core machine, BERT-large in several times that.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MODELS = {'bert-base': 'bert-base-uncased', 'bert-large': 'bert-large-uncased'}
# name -> (config file, global batch, micro_batch_size): the papers' recipes (unsupervised
# batch 64, supervised 512) and the large batches pods are booked for.
CASES = {
    'unsup-64': ('unsup_simcse_bert_base.py', 64, 0),
    'unsup-512': ('unsup_simcse_bert_base.py', 512, 0),
    'sup-512': ('sup_simcse_bert_base.py', 512, 0),
    'sup-4096': ('sup_simcse_bert_base.py', 4096, 0),
    'sup-32768': ('sup_simcse_bert_base.py', 32768, 4096),
}
# name -> (topology, slices)
TOPOLOGIES = {'v4-32': ('v4-32', 1), 'v5e-256': ('v5e-256', 1), 'v5p-128': ('v5p-128', 1),
              '2xv5e-256': ('v5e-256', 2)}


# The mesh a plan names when the batch has fewer rows than the mesh has batch shards.
_MESH_HINT = re.compile(r'split the model over the other devices: (--config\.mesh_data=\d+ '
                        r'--config\.mesh_tensor=\d+(?: --config\.replicate_indivisible=True)?)$')


def _run_plan(model: str, case: str, topology: str, search: bool, log,
              overrides: tuple[str, ...] = ()) -> tuple[Optional[dict], str]:
    """One plan process: (its JSON, '') or (None, the one-line error it gave)."""
    config, batch, micro = CASES[case]
    topo, slices = TOPOLOGIES[topology]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / 'plan.json'
        cmd = [sys.executable, '-m', 'jaxsim', 'plan', '--config', str(ROOT / 'configs' / config),
               '--topology', topo, '--num-slices', str(slices), '--no-encode',
               f'--config.model={MODELS[model]}', f'--config.batch_size={batch}',
               f'--config.micro_batch_size={micro}', *overrides, '--json', str(out)]
        if not search:
            cmd.append('--no-search')
        log(f'{model} {case} on {topology}: {" ".join(cmd[3:])}')
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env=dict(os.environ, JAX_PLATFORMS='cpu'))
        if proc.returncode != 0 or not out.exists():
            errors = [x for x in proc.stderr.splitlines() if x.startswith('error:')]
            return None, errors[-1] if errors else proc.stderr.strip()[-300:]
        return json.loads(out.read_text()), ''


def plan_one(model: str, case: str, topology: str, search: bool, log) -> dict:
    """One row: the plan of the case as configured; where the plan refuses the batch for having
    fewer rows than the pod's batch shards, the plan of the mesh it names instead."""
    _, batch, micro = CASES[case]
    row = {'model': model, 'case': case, 'topology': topology, 'batch': batch,
           'micro_batch_size': micro}
    plan, error = _run_plan(model, case, topology, search, log)
    hint = _MESH_HINT.search(error)
    if hint:
        row['as_configured'] = error
        plan, error = _run_plan(model, case, topology, search, log, tuple(hint[1].split()))
    if plan is None:
        row['error'] = error
        return row
    suggestion = plan.get('suggestion') or {}
    row.update(
        fits=plan['fits'], hbm_gib=plan['hbm_gib']['total'],
        capacity_gib=plan['hbm_gib']['capacity'], step_s_estimate=plan['step_s_estimate'],
        mfu_ceiling=plan['mfu_ceiling'], bound=plan['bound'], mesh=plan['mesh'],
        collectives=plan['collectives'], max_global_batch=plan['max_global_batch'],
        recommended=(hint[1] if hint and plan['fits'] else
                     'as configured: mesh ' + 'x'.join(f'{k}={v}' for k, v in
                                                       plan['mesh'].items() if v > 1)
                     if plan['fits'] else suggestion.get('flags') or
                     suggestion.get('note') or 'does not fit (plan with --search)'),
        compile_s=plan['compile_s'])
    return row


# Collective kinds as the table names them.
_SHORT = {'all-gather': 'AG', 'all-reduce': 'AR', 'reduce-scatter': 'RS', 'all-to-all': 'A2A',
          'collective-permute': 'permute'}


def collectives_cell(counts: dict) -> str:
    """'3 AG, 5 AR': the kinds the compiled step holds, in the plan's order."""
    return ', '.join(f'{n} {_SHORT.get(kind, kind)}' for kind, n in counts.items() if n) or 'none'


def markdown(rows: list[dict]) -> str:
    lines = ['| model | case | topology | fits | HBM GiB/chip | step ms (est.) | MFU ceiling '
             '| collectives | recommended |', '|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        if 'error' in r:
            lines.append(f"| {r['model']} | {r['case']} | {r['topology']} | - | - | - | - | - | "
                         f"{r['error']} |")
            continue
        lines.append(f"| {r['model']} | {r['case']} | {r['topology']} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['hbm_gib']:.2f} of "
                     f"{r['capacity_gib']:.1f} | "
                     + ('- | - |' if r['step_s_estimate'] is None else  # refused: no cost
                        f"{r['step_s_estimate'] * 1e3:.1f} | {r['mfu_ceiling']:.1%} |")
                     + f" {collectives_cell(r['collectives'])} | {r['recommended']} |")
    return '\n'.join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', default=','.join(MODELS))
    p.add_argument('--cases', default=','.join(CASES))
    p.add_argument('--topologies', default=','.join(TOPOLOGIES))
    p.add_argument('--search', action='store_true',
                   help='also the largest batch and, for a batch that does not fit, settings '
                        'that fit (more compiles)')
    p.add_argument('--json', type=Path, default=None)
    p.add_argument('--markdown', type=Path, default=None)
    args = p.parse_args(argv)
    picks = []
    for flag, known in (('models', MODELS), ('cases', CASES), ('topologies', TOPOLOGIES)):
        names = [x for x in getattr(args, flag).split(',') if x]
        unknown = sorted(set(names) - set(known))
        if unknown:
            p.error(f'--{flag}: unknown {", ".join(unknown)} (known: {", ".join(known)})')
        picks.append(names)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = [plan_one(m, c, t, args.search, log)
            for m in picks[0] for c in picks[1] for t in picks[2]]
    table = markdown(rows)
    print(table)
    print('(the TPU compiler\'s estimates and the chips\' published peaks, not measurements)')
    if args.markdown:
        args.markdown.write_text(table + '\n')
    if args.json:  # no reference to race: a table of estimates, no ratio
        args.json.write_text(json.dumps({
            'rows': rows, 'compiled_on': common.cpu_description(),
            'load_average_1min': common.load_average(),
            'note': "the TPU compiler's estimates (libtpu on this machine), not measurements"},
            indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
