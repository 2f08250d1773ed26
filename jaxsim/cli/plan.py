"""`python -m jaxsim plan`: a train config compiled for a TPU topology on this machine.

    python -m jaxsim plan --config configs/unsup_simcse_bert_base.py --topology v5e:4x4 \\
        [--num-slices N] [--config.KEY=VALUE ...] [--json PATH] [--no-encode] [--no-search]

Prints, per chip: HBM by kind against the capacity and whether it fits, FLOPs, bytes
accessed, every collective (kind, mesh axes, ICI or DCN, size), a roofline step time and MFU
ceiling, the largest global batch that fits, and for a batch that does not fit, planned
settings that do. Needs libtpu (`pip install "jax[tpu]==<jax version>"`), not a TPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import jax

from jaxsim.cli import cli_io
from jaxsim.plan.chips import parse_topology
from jaxsim.plan.planner import make_plan
from jaxsim.storage import store
from jaxsim.train.config import TrainConfig
from jaxsim.train.config_files import apply_overrides, load_config_file
from jaxsim.train.step import configure_jax

# Operations of the step's breakdown printed (the JSON holds more).
BREAKDOWN_LINES = 8


def _loops_counted(r: dict) -> str:
    """How the loops are counted, where a loop runs more than once: XLA's own totals count
    each body once."""
    repeated = [x for x in r['loops'] if x['runs'] > 1]
    if not repeated:
        return ''
    xla = r['xla_cost_analysis_per_chip']
    runs = ', '.join(str(x['runs']) for x in repeated)
    return (f"; loop bodies counted as often as they run: {runs} times; XLA's totals count "
            f"each once: {xla['flops'] / 1e12:.3f} TFLOP, {xla['bytes accessed'] / 1e9:.2f} GB")


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog='python -m jaxsim plan',
        description='Compile the train step (and the encode program) of a config for a TPU '
                    'topology on this machine, and report memory, cost, collectives and a '
                    'roofline step time per chip (the compiler\'s estimates).')
    p.add_argument('--config', required=True, help='configs/NAME.py (or NAME.py:ARG)')
    p.add_argument('--topology', required=True,
                   help='CHIP:GRID (v5e:4x4, v5p:4x4x4, v4:2x2x4, v6e:8x8) or an accelerator '
                        'type (v5e-256, v4-32, v5p-128)')
    p.add_argument('--num-slices', type=int, default=1,
                   help='slices joined over the data-center network (multislice)')
    cli_io.add_output_flags(p, '--json', 'also write the plan as JSON here',
                            overwrite_help='replace an existing --json file')
    p.add_argument('--no-encode', dest='encode', action='store_false',
                   help='plan the train step only')
    p.add_argument('--hlo-dir', default=None,
                   help='also write each compiled program\'s partitioned HLO text here '
                        '(train_step.hlo, encode.hlo): what its bytes and collectives are')
    p.add_argument('--no-search', dest='search', action='store_false',
                   help='one compile: no largest-batch estimate, no settings that fit')
    return cli_io.add_import_flag(p)


def parse_plan_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    p = plan_parser()
    args, rest = p.parse_known_args(argv)
    overrides = cli_io.config_overrides(p, rest)
    if args.num_slices < 1:
        p.error(f'--num-slices must be >= 1, got {args.num_slices}')
    return args, overrides


def plan_main(argv: Sequence[str]) -> int:
    args, overrides = parse_plan_args(argv)
    return run_plan(args.config, overrides, args.topology, args.num_slices, args.json,
                    args.overwrite, encode=args.encode, search=args.search,
                    hlo_dir=args.hlo_dir)


def run_plan(config: str, overrides: Sequence[str], topology: str, num_slices: int = 1,
             json_path: Optional[str] = None, overwrite: bool = False, *, encode: bool = True,
             search: bool = True, hlo_dir: Optional[str] = None) -> int:
    """The plan command's work (also `train.py --plan`): every input checked before the
    first compile, the report on stdout, the JSON written whole."""
    # Cheap checks first: the topology, the config, the output.
    topo = parse_topology(topology)
    fields = apply_overrides(load_config_file(config), list(overrides))
    if fields.get('data_format', 'text') in ('text', 'csv') and not fields.get('train_file'):
        fields['train_file'] = '(none: a plan reads no data)'  # shapes come from the config
    cfg = TrainConfig.from_dict(fields, source=config)
    output = (cli_io.check_output_file(json_path, overwrite, '--json',
                                       inputs=[('--config', config if Path(config).is_file()
                                                           else config.partition(':')[0])])
              if json_path else None)
    if hlo_dir:  # a folder the HLO files go into (replaced there), checked before the compile
        cli_io.check_output_dir(hlo_dir, True, '--hlo-dir')
    # Several planning processes may share this machine (libtpu otherwise takes a lock).
    os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
    # The plan compiles for the topology's compile-only devices; the process itself needs no
    # accelerator (and must not take a TPU another process is using).
    jax.config.update('jax_platforms', os.environ.get('JAX_PLATFORMS') or 'cpu')
    # A program compiled for compile-only devices cannot be stored or read back.
    jax.config.update('jax_enable_compilation_cache', False)
    configure_jax()
    plan = make_plan(cfg, topo, num_slices, encode=encode, search=search)
    record = plan.to_json()
    print(format_plan(record))
    if output is not None:  # first: the JSON is the plan's record
        store.write_atomic(output, json.dumps(record, indent=2) + '\n', overwrite, '--json')
        print(f'wrote {output}', file=sys.stderr)
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        for program in (plan.train.program, plan.encode):
            if program is not None:
                store.write_atomic(Path(hlo_dir) / f"{program.name.replace(' ', '_')}.hlo",
                                   program.hlo_text, what='--hlo-dir')
        print(f'wrote the compiled HLO to {hlo_dir}', file=sys.stderr)
    return 0


def _counts(collectives: dict) -> str:
    """'2 all-reduce, 1 all-gather' (the kinds that occur), or 'none'."""
    return ', '.join(f'{n} {kind}' for kind, n in collectives.items() if n) or 'none'


def format_plan(r: dict) -> str:
    """The plan as the lines the command prints."""
    h = r['hbm_gib']
    slices = f' x {r["num_slices"]} slices' if r['num_slices'] > 1 else ''
    per = ' (per TensorCore: 2 devices a chip)' if r['devices_per_chip'] > 1 else ''
    cfg = r['config']
    lines = [
        f"plan: {cfg['model']} {cfg['objective']}, global batch {cfg['batch_size']} x "
        f"{cfg['max_len']} tokens, {cfg['dtype']}, remat {cfg['remat']}, micro_batch_size "
        f"{cfg['micro_batch_size']}",
        f"  on {r['topology']}{slices}: {r['devices']} devices, mesh {r['mesh']}{per}",
        f"HBM per device: {h['total']:.2f} of {h['capacity']:.2f} GiB -> "
        f"{'fits' if r['fits'] else 'DOES NOT FIT'}",
        f"  parameters {h['parameters']:.3f}, optimizer state {h['optimizer_state']:.3f}, "
        f"batch {h['batch']:.4f}, temporaries {h['temporaries']:.3f}, program "
        f"{h['program']:.3f}, other {h['other_arguments'] + h['outputs_not_aliased']:.3f} GiB",
    ]
    if cfg['remat'] != 'none' or cfg['micro_batch_size']:
        # Why they may shrink the total less than the temporaries: they act on nothing else.
        lines.append(f"  remat and micro-batches shrink the temporaries only ("
                     f"{h['temporaries']:.3f} of {h['total']:.3f} GiB); parameters, optimizer "
                     f"state, batch and program ({h['total'] - h['temporaries']:.3f} GiB) stay, "
                     f"so no setting of them brings the total under that")
    if r['compiled']:
        lines += [
            f"per chip: {r['flops_per_chip'] / 1e12:.3f} TFLOP, {r['bytes_per_chip'] / 1e9:.2f} "
            f"GB accessed (XLA cost analysis{_loops_counted(r)})",
            f"roofline: compute {r['compute_s'] * 1e3:.2f} ms, HBM {r['hbm_s'] * 1e3:.2f} ms, ICI "
            f"{r['ici_s'] * 1e3:.2f} ms, DCN {r['dcn_s'] * 1e3:.2f} ms -> step "
            f"{r['step_s_estimate'] * 1e3:.2f} ms ({r['bound']}-bound), MFU ceiling "
            f"{r['mfu_ceiling']:.1%} (of the model's {r['model_flops_per_chip'] / 1e12:.3f} "
            f"TFLOP: {r['mfu_ceiling_model_flops']:.1%})",
            f"collectives: {_counts(r['collectives'])}"]
        ops = r['breakdown']['operations'][:BREAKDOWN_LINES]
        if ops:
            lines.append("where the step's time goes (the TPU compiler's cost model, share of "
                         f"{r['breakdown']['estimated_cycles'] / 1e6:.1f} M cycles; JSON: "
                         f"{len(r['breakdown']['operations'])} rows):")
            lines += [f"  {o['cycles_share']:6.1%}  {o['instructions']:4d} instr  "
                      f"{o['op'][-80:]}" for o in ops]
    else:
        lines.append(f"the compiler refused the step: its temporaries alone need "
                     f"{h['temporaries']:.2f} GiB (no cost figures for a program it refuses)")
    for c in r['collective_list']:
        axes = '+'.join(c['axes']) or '-'
        runs = f"x{c['runs']}" if c['runs'] > 1 else ''
        lines.append(f"  {c['kind']:<18} over {axes:<12} {c['network']}  {c['mib']:10.3f} MiB"
                     f"{runs:>5}  {c['op'][-60:]}")
    if r['max_global_batch'] is not None:
        lines.append(f"largest global batch that fits: {r['max_global_batch']} "
                     f"({r['max_global_batch_note']})")
    elif r['max_global_batch_note']:
        lines.append(f"largest global batch: {r['max_global_batch_note']}")
    s = r.get('suggestion')
    if s:
        if s.get('fits'):
            lines.append(f"fits with: {s['flags']} (planned: {s['hbm_gib']:.2f} GiB, step "
                         f"{s['step_s_estimate'] * 1e3:.2f} ms, MFU ceiling "
                         f"{s['mfu_ceiling']:.1%})")
        else:
            lines.append(f"no setting tried fits: {s['note']}")
    if 'encode' in r:
        e = r['encode']
        lines.append(f"encode ({e['batch']} x {e['max_len']} tokens, float32): "
                     f"{e['hbm_gib']:.2f} GiB {'fits' if e['fits'] else 'DOES NOT FIT'}, "
                     f"{e['step_s_estimate'] * 1e3:.2f} ms a batch, collectives "
                     f"{_counts(e['collectives'])}")
    lines.append('(the compiler\'s estimates and the chip\'s published peaks, not measurements)')
    return '\n'.join(lines)

