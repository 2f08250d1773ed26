"""The README's walkthrough runs as written (with tiny settings), and every command line in the
README and docs/ names flags its command accepts and files that exist."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxsim.cli import analyze as analyze_cli
from jaxsim.cli import cli_io
from jaxsim.cli import encode as encode_cli
from jaxsim.cli import eval as eval_cli
from jaxsim.cli import export as export_cli
from jaxsim.cli import plan as plan_cli
from jaxsim.cli import prepare as prepare_cli
from jaxsim.cli import search as search_cli
from jaxsim.cli import serve as serve_cli
from jaxsim.cli import train as train_cli
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]
# What the walkthrough's steps get on top of what the README says, to take seconds: a short
# run, small batches, short sentences and evaluation length, and XLA's cheapest compile of the
# train step (compiling it at full effort took longer than the whole run).
TINY_TRAIN = ['--config.max_steps=2', '--config.batch_size=4', '--config.eval_every=2',
              '--config.eval_max_len=16', '--config.eval_batch_size=16', '--config.max_len=16',
              '--config.fast_compile=True']


def code_blocks(text: str):
    """(language, body) of every fenced block of a markdown text."""
    return re.findall(r'^```(\w*)\n(.*?)^```', text, re.S | re.M)


def command_lines(body: str):
    """The shell commands of a code block: continuation lines joined, comments dropped."""
    body = body.replace('\\\n', ' ')
    return [line.split(' #')[0].strip() for line in body.splitlines()
            if line.strip() and not line.lstrip().startswith('#')]


def walkthrough() -> list[str]:
    text = (REPO / 'README.md').read_text()
    after = text.split('<!-- walkthrough', 1)[1]
    return command_lines(code_blocks(after)[0][1])


def tiny_senteval(root: Path) -> Path:
    """The shipped data cut short: the first lines of SNLI dev/test and 40 STS-B pairs."""
    for rel, lines in [*((f'SNLI/{n}.{s}', 120) for n in ('s1', 's2', 'labels')
                         for s in ('dev', 'test')),
                       ('STS/STSBenchmark/sts-dev.csv', 40), ('STS/STSBenchmark/sts-test.csv', 40)]:
        out = root / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        kept = (SENTEVAL_ROOT / rel).read_text().splitlines()[:lines]
        out.write_text('\n'.join(kept) + '\n')
    return root


def test_walkthrough_runs_as_written(tmp_path):
    """A fresh folder laid out as the repository beside ../shared/data/senteval, the data cut
    short; each README line runs in order and must succeed."""
    work = tmp_path / 'jaxsim'
    work.mkdir()
    for name in ('train.py', 'eval.py', 'configs'):
        (work / name).symlink_to(REPO / name)
    data = tiny_senteval(tmp_path / 'shared' / 'data' / 'senteval')
    env = dict(os.environ, JAXSIM_SENTEVAL=str(data), JAX_PLATFORMS='cpu',
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    commands = walkthrough()
    assert [c.split()[1] for c in commands] == ['train.py', 'eval.py', '-m', '-m', '-m']
    for command in commands:
        args = shlex.split(command)
        assert args[0] == 'python'
        if args[1] == 'train.py':
            args += TINY_TRAIN
        proc = subprocess.run([sys.executable, *args[1:]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        assert 'Traceback' not in proc.stderr, command
    assert (work / 'runs' / 'sup-eval.json').is_file()
    assert (work / 'runs' / 'sup-st' / 'modules.json').is_file()
    assert (work / 'runs' / 'snli-index' / 'index.json').is_file()
    for line in proc.stdout.splitlines():  # search: <cosine><TAB><sentence>
        score, sentence = line.split('\t')
        assert -1.0 <= float(score) <= 1.0 and sentence


def _parsers():
    """Command name -> a function that parses its arguments (raising on unknown flags)."""
    def jaxsim_command(args):
        name, rest = args[0], args[1:]
        if name == 'plan':  # --config.KEY=VALUE overrides: parsed as the command parses them
            with cli_io.usage_errors_as_exceptions():
                plan_cli.parse_plan_args(rest)
            return
        parser = {'encode': encode_cli.encode_parser, 'export': export_cli.export_parser,
                  'index': search_cli.index_parser, 'search': search_cli.search_parser,
                  'serve': serve_cli.serve_parser, 'prepare': prepare_cli.prepare_parser,
                  'analyze': analyze_cli.analyze_parser}[name]()
        with cli_io.usage_errors_as_exceptions():
            parser.parse_args(rest)

    def train(args):
        options, overrides = train_cli.parse_args(args)
        if '/' in options.config:  # a path, not a placeholder
            assert (REPO / options.config.split(':')[0]).is_file(), options.config

    return {'eval.py': eval_cli.parse_args, 'train.py': train,
            '-m': lambda a: jaxsim_command(a[1:])}


def documented_commands():
    for page in DOCS:
        text = page.read_text()
        commands = [c for lang, body in code_blocks(text) if lang in ('bash', '')
                    for c in command_lines(body)]
        commands += re.findall(r'`(python [^`]+)`', text)
        for command in commands:
            if command.startswith('python '):
                yield page.name, command


@pytest.mark.parametrize('page, command', list(documented_commands()))
def test_documented_command_lines_parse(page, command):
    """Every `python ...` line of the docs: its flags exist (benchmarks: in the script's
    source), the scripts and configs it names exist. Optional parts in [brackets] are checked
    too."""
    command = re.sub(r'\[([^\]]*)\]', r'\1', command)
    args = shlex.split(command)[1:]
    if args[0].startswith('benchmarks/'):
        source = (REPO / args[0]).read_text()
        for flag in (a.split('=')[0] for a in args[1:] if a.startswith('--')):
            assert f'"{flag}"' in source or f"'{flag}'" in source, (page, flag)
        return
    if args[0] == '-m':
        assert args[1] == 'jaxsim', command
        args = args[1:]
    if args[0] == 'jaxsim' and args[1].startswith('{'):
        return  # the layout page's summary of the subcommands
    _parsers()[args[0] if args[0] != 'jaxsim' else '-m'](args if args[0] == 'jaxsim' else args[1:])


def test_readme_is_short_and_links_resolve():
    readme = (REPO / 'README.md').read_text()
    assert len(readme.encode()) <= 8 * 1024
    for page in DOCS:
        for target in re.findall(r'\]\(([^)#]+\.md)\)', page.read_text()):
            if target in ('docs/pod.md', 'docs/serve.md', 'docs/goldens.md', 'pod.md',
                          'serve.md', 'goldens.md') and not (page.parent / target).exists():
                continue  # pages being written alongside
            assert (page.parent / target).is_file(), (page.name, target)
