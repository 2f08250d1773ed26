"""User code in every command: a module written outside the repository registers an objective,
a pooler, a calibration and a flow layer; train.py, eval.py, export, encode and serve use them
through `--import` (and `$JAXSIM_PLUGINS`), each run checked against the plugin's own effect
computed here. Failing modules, clashing names and unknown names are one line naming both."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

import jaxsim
from jaxsim import calibrate, plugins
from jaxsim.cli import cli_io
from jaxsim.export import RECORD_FILE
from jaxsim.plugins import PluginError
from jaxsim.search import build_index
from tests.conftest import HANG_GUARD_S, write_run_data, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
SENTENCES = ["a man is playing a guitar .", "a woman slices an onion .",
             "the cat sat on the mat .", "two dogs run across a wide green field .",
             "a child reads a book .", "an old man walks along the beach at dusk ."]

PLUGIN = '''
"""A researcher's module: one entry in each of jaxsim's four registries."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.calibrate import CALIBRATIONS, AffineCalibration
from jaxsim.flows import FLOW_LAYERS, FlowOutput
from jaxsim.formats.st_modules import st_dense, st_pooling
from jaxsim.models.poolers import masked_mean, register_pooler
from jaxsim.objectives import register_objective


@register_objective("plug_infonce", views=2, from_single=True)
def plug_infonce(z, temp=0.1):
    a = z[:, 0] / jnp.linalg.norm(z[:, 0], axis=-1, keepdims=True)
    b = z[:, 1] / jnp.linalg.norm(z[:, 1], axis=-1, keepdims=True)
    loss = -jnp.mean(jnp.diagonal(jax.nn.log_softmax(a @ b.T / temp, axis=-1)))
    return loss, {"plug_marker": jnp.asarray(7.0)}


def _export_triple_mean(params, config, use_head):
    h = config.hidden_size
    return [st_pooling(h, "mean"), st_dense(3.0 * np.eye(h, dtype=np.float32),
                                            np.zeros(h, np.float32),
                                            "torch.nn.modules.linear.Identity")]


@register_pooler("plug_triple_mean", export=_export_triple_mean)
def triple_mean(output, attention_mask):
    return 3.0 * masked_mean(output.hidden_states[-1], attention_mask)


@CALIBRATIONS.register("plug_shrinkw")
class ShrinkWhitening(AffineCalibration):
    arg = "required"
    arg_type = float

    @classmethod
    def fit(cls, x, arg):
        x = np.asarray(x, np.float64)
        return cls(mu=x.mean(axis=0), W=np.diag(1.0 / (x.std(axis=0) + arg)))


@FLOW_LAYERS.register("plug_diag_affine")
class DiagAffine(nn.Module):
    features: int

    def setup(self):
        self.log_scale = self.param("log_scale", nn.initializers.zeros, (self.features,))
        self.shift = self.param("shift", nn.initializers.zeros, (self.features,))

    def forward(self, x):
        return FlowOutput(x * jnp.exp(self.log_scale) + self.shift,
                          jnp.full(x.shape[:1], jnp.sum(self.log_scale)))

    def inverse(self, z):
        return (z - self.shift) * jnp.exp(-self.log_scale)
'''

FLOW_CONFIG = '''
from jaxsim.flows.config import FlowConfig, layer


def get_config():
    return FlowConfig(name="plug", levels=1, depth=2, step=(layer("plug_diag_affine"),),
                      objective="nats", optimizer="adam", learning_rate=0.05, weight_decay=0.0,
                      batch_size=16, max_epochs=20, val_fraction=0.0)
'''


def _env(**extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(plugins.ENV_VAR, None)
    return {**env, **extra}


def run(*args, ok=True, env=None):
    """`python ARGS` from the repository root; with ok, a non-zero exit fails the test."""
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env or _env(),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), \
        proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The module's path, outside the repository; loaded here too, to compute its effects."""
    path = tmp_path_factory.mktemp("user_code") / "jaxsim_user_plug.py"
    path.write_text(PLUGIN)
    assert REPO not in path.resolve().parents
    plugins.load_module(str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plug_model") / "tiny-bert"
    write_tiny_model(folder, "bert", seed=5)
    return folder, jaxsim.load_pretrained(folder)


def triple_mean(model, sentences):
    """The plugin pooler's vectors, from the built-in mean pooler."""
    return 3.0 * jaxsim.encode(model, sentences, pooler="avg")


def shrinkw(fit, x, a):
    """The plugin calibration, by hand."""
    fit = np.asarray(fit, np.float64)
    return (np.asarray(x, np.float64) - fit.mean(0)) / (fit.std(0) + a)


# ------------------------------------------------------------------------------ per command
def test_train_with_the_users_objective_and_pooler(plugin, tmp_path):
    data = write_run_data(tmp_path, "s1.dev", 48, 8)
    workdir = tmp_path / "run"
    run("train.py", "--import", plugin, "--config", REPO / "configs" / "tiny_unsup_simcse.py",
        "--workdir", workdir, f"--config.train_file={data / 'corpus.txt'}",
        "--config.objective=plug_infonce", "--config.objective_kwargs.temp=0.2",
        "--config.pooler=plug_triple_mean", "--config.mlp_only_train=False",
        "--config.max_steps=2", "--noprogress")
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["plug_marker"] == 7.0 for r in logged)  # the plugin's loss ran, its aux logged
    model = jaxsim.load_pretrained(workdir)
    assert model.pooler == "plug_triple_mean"
    np.testing.assert_allclose(jaxsim.encode(model, SENTENCES[:3]),
                               triple_mean(model, SENTENCES[:3]), rtol=1e-5, atol=1e-5)

    # The workdir names the pooler; a command without the module says which name, and how.
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n")
    line = one_error_line(run("-m", "jaxsim", "encode", "--model", workdir, "--input",
                              tmp_path / "in.txt", "--output", tmp_path / "v.npy", ok=False))
    assert "unknown pooler 'plug_triple_mean'" in line and "--import MODULE" in line


def test_eval_with_the_users_calibration_and_flow_layer(plugin, tiny, tmp_path):
    folder, model = tiny
    data = write_run_data(tmp_path, "s1.dev", 8, 40) / "senteval"
    fit_file = tmp_path / "fit.txt"
    fit_sentences = [f"{s} number {i}" for i, s in enumerate(SENTENCES * 8)]
    fit_file.write_text("\n".join(fit_sentences) + "\n")
    (tmp_path / "plug_flow.py").write_text(FLOW_CONFIG)
    out = tmp_path / "res.json"
    run("eval.py", "--import", plugin, "--model", folder, "--data", data, "--tasks", "stsb",
        "--post", "none", "--post", "plug_shrinkw:0.3",
        "--post", f"flow:{tmp_path / 'plug_flow.py'}",
        "--fit-on", fit_file, "--no-diagnostics", "--json", out)
    rows = {r["post"].split(":")[0]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"none", "plug_shrinkw", "flow"}
    assert rows["plug_shrinkw"]["post"] == "plug_shrinkw:0.3"

    pairs = [line.split("\t") for line in
             (data / "STS" / "STSBenchmark" / "sts-test.csv").read_text().splitlines()]
    gold = [float(p[4]) for p in pairs]
    fit = jaxsim.encode(model, fit_sentences)
    a, b = (shrinkw(fit, jaxsim.encode(model, [p[i] for p in pairs]), 0.3) for i in (5, 6))
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    want = 100 * scipy.stats.spearmanr(cos, gold)[0]
    assert rows["plug_shrinkw"]["tasks"]["STSBenchmark"] == pytest.approx(want, abs=1e-3)
    assert rows["plug_shrinkw"]["tasks"]["STSBenchmark"] != rows["none"]["tasks"]["STSBenchmark"]
    flow = rows["flow"]
    assert "plug_diag_affine" in json.dumps(flow["details"])  # the user's layer was fitted
    assert np.isfinite(flow["tasks"]["STSBenchmark"])
    assert flow["tasks"]["STSBenchmark"] != rows["none"]["tasks"]["STSBenchmark"]


def test_export_with_the_users_pooler_and_calibration(plugin, tiny, tmp_path):
    from sentence_transformers import SentenceTransformer

    folder, model = tiny
    fit_sentences = [f"{s} again {i}" for i, s in enumerate(SENTENCES * 6)]
    (tmp_path / "fit.txt").write_text("\n".join(fit_sentences) + "\n")
    run("-m", "jaxsim", "export", "--import", plugin, "--checkpoint", folder,
        "--out", tmp_path / "st", "--format", "sentence-transformers",
        "--pooler", "plug_triple_mean", "--post", "plug_shrinkw:0.3", "--fit-data",
        tmp_path / "fit.txt")
    want = shrinkw(triple_mean(model, fit_sentences), triple_mean(model, SENTENCES), 0.3)
    got = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(
        SENTENCES, convert_to_numpy=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_export_bakes_in_a_saved_calibration_of_an_unloaded_kind(plugin, tiny, tmp_path):
    """The module is not imported: the saved file still holds the whole affine map."""
    from sentence_transformers import SentenceTransformer

    folder, model = tiny
    fit = jaxsim.encode(model, [f"{s} {i}" for i, s in enumerate(SENTENCES * 6)])
    calibrate.fit("plug_shrinkw:0.3", fit).save(tmp_path / "cal")
    proc = run("-m", "jaxsim", "export", "--checkpoint", folder, "--out", tmp_path / "st",
               "--format", "sentence-transformers", "--calibration", tmp_path / "cal")
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "'plug_shrinkw' is not registered" in notes[0], proc.stderr
    got = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(
        SENTENCES, convert_to_numpy=True)
    np.testing.assert_allclose(got, shrinkw(fit, jaxsim.encode(model, SENTENCES), 0.3),
                               rtol=1e-4, atol=1e-4)
    record = json.loads((tmp_path / "st" / RECORD_FILE).read_text())
    assert record["post"]["kind"] == "plug_shrinkw"
    assert record["post"]["spec"] == "plug_shrinkw:0.3"


def test_encode_through_import_and_the_environment(plugin, tiny, tmp_path):
    folder, model = tiny
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n")
    want = triple_mean(model, SENTENCES)
    # The flag may come after the name it defines.
    run("-m", "jaxsim", "encode", "--model", folder, "--pooler", "plug_triple_mean",
        "--input", tmp_path / "in.txt", "--output", tmp_path / "a.npy", "--import", plugin)
    np.testing.assert_allclose(np.load(tmp_path / "a.npy"), want, rtol=1e-5, atol=1e-5)
    # $JAXSIM_PLUGINS with a dotted name, found on PYTHONPATH.
    env = _env(JAXSIM_PLUGINS=f" {plugin.stem} ",
               PYTHONPATH=f"{REPO}{os.pathsep}{plugin.parent}")
    run("-m", "jaxsim", "encode", "--model", folder, "--pooler", "plug_triple_mean",
        "--input", tmp_path / "in.txt", "--output", tmp_path / "b.npy", env=env)
    np.testing.assert_allclose(np.load(tmp_path / "b.npy"), want, rtol=1e-5, atol=1e-5)


def test_serve_an_index_of_the_users_pooler(plugin, tiny, tmp_path):
    from tests.serve.conftest import Server

    _, model = tiny
    build_index(model.with_pooler("plug_triple_mean"), SENTENCES).save(tmp_path / "index")
    server = Server(tmp_path / "index", tmp_path, "--host", "127.0.0.1", "--import", plugin)
    try:
        with urllib.request.urlopen(server.url + "/health") as r:
            assert json.loads(r.read())["pooler"] == "plug_triple_mean"
        req = urllib.request.Request(server.url + "/encode",
                                     data=json.dumps({"sentences": SENTENCES[:2]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            vectors = np.asarray(json.loads(r.read())["vectors"])
    finally:
        server.stop()
    np.testing.assert_allclose(vectors, triple_mean(model, SENTENCES[:2]), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------- errors
def test_a_module_that_fails_is_one_line_naming_it(tmp_path):
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("import numpy\nraise RuntimeError('the config server\\nis down')\n")
    with pytest.raises(PluginError) as e:
        plugins.load_module(str(broken))
    assert str(e.value) == (f"--import {broken}: {broken.resolve()}:2: RuntimeError: the config "
                            "server is down")
    assert "broken_plugin" not in sys.modules  # a later fixed copy can load
    with pytest.raises(PluginError, match=r"^--import no_such_module_xyz: ModuleNotFoundError: "
                                          r"No module named 'no_such_module_xyz'$"):
        plugins.load_module("no_such_module_xyz")
    with pytest.raises(PluginError, match=r"^--import .*missing\.py: FileNotFoundError"):
        plugins.load_module(str(tmp_path / "missing.py"))
    # Through a command: one line, exit 1, before any training.
    line = one_error_line(run("train.py", "--config", "configs/tiny_unsup_simcse.py",
                              "--workdir", tmp_path / "w", "--import", broken, ok=False))
    assert line == (f"error: --import {broken}: {broken.resolve()}:2: RuntimeError: the config "
                    "server is down")  # the module is at fault: no "(see train.py --help)"
    assert not (tmp_path / "w").exists()


def test_a_clashing_or_unknown_name_is_one_line_naming_module_and_name(plugin, tmp_path):
    clash = tmp_path / "clash_plugin.py"
    clash.write_text("from jaxsim.models.poolers import register_pooler\n"
                     "@register_pooler('avg')\n"
                     "def mine(output, mask):\n    return output.hidden_states[-1][:, 0]\n")
    with pytest.raises(PluginError) as e:
        plugins.load_module(str(clash))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--import {clash}: {clash.resolve()}:2: "
                                               "PoolerError: pooler 'avg' ")
    assert "(in clash_plugin)" in msg and "registered by jaxsim.models.poolers" in msg

    twice = tmp_path / "twice_plugin.py"
    twice.write_text("from jaxsim.calibrate import CALIBRATIONS, AffineCalibration\n"
                     "@CALIBRATIONS.register('plug_shrinkw')\n"
                     "class Again(AffineCalibration):\n    pass\n")
    with pytest.raises(PluginError, match="calibration 'plug_shrinkw' \\(in twice_plugin\\) is "
                                          "already registered by jaxsim_user_plug"):
        plugins.load_module(str(twice))

    unknown = tmp_path / "unknown_plugin.py"
    unknown.write_text("from jaxsim.objectives import get_objective\n"
                       "BASE = get_objective('infonce_of_my_colleague')\n")
    with pytest.raises(PluginError) as e:
        plugins.load_module(str(unknown))
    assert str(e.value).startswith(f"--import {unknown}: {unknown.resolve()}:2: ObjectiveError: "
                                   "unknown objective 'infonce_of_my_colleague'")
    with pytest.raises(calibrate.CalibrationError, match="unknown calibration 'shrinkx'.*--import"):
        calibrate.parse_spec("shrinkx:0.3")


def test_a_failure_names_the_file_and_line_of_the_users_code(tmp_path, monkeypatch):
    """The deepest frame in the user's own files: not jaxsim's, not a library's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "wrong_call_plugin.py").write_text(
        "from jaxsim.objectives import register_objective\n\n\n"
        "def loss(z):\n    return z.sum(), {}\n"
        "register_objective()(loss)\n")  # line 6; raised inside jaxsim
    with pytest.raises(PluginError) as e:
        plugins.load_module("wrong_call_plugin.py")
    assert str(e.value).startswith("--import wrong_call_plugin.py: wrong_call_plugin.py:6: "
                                   "TypeError: register_objective() missing 1 required ")

    (tmp_path / "library_plugin.py").write_text("import json\nCONFIG = json.loads('{')\n")
    with pytest.raises(PluginError) as e:
        plugins.load_module("library_plugin.py")  # raised inside the json module
    assert str(e.value).startswith("--import library_plugin.py: library_plugin.py:2: "
                                   "JSONDecodeError: ")

    # A module the user's module imports: that module's file and line.
    (tmp_path / "nested_helper_plugin.py").write_text("X = 1\n\nraise ValueError('no data')\n")
    (tmp_path / "nested_top_plugin.py").write_text("import nested_helper_plugin  # noqa\n")
    with pytest.raises(PluginError) as e:
        plugins.load_module("nested_top_plugin.py")
    assert str(e.value) == ("--import nested_top_plugin.py: nested_helper_plugin.py:3: "
                            "ValueError: no data")
    (tmp_path / "nested_syntax_plugin.py").write_text("import numpy\n\n\ndef f(x):\n"
                                                      "    return x +\n")
    (tmp_path / "syntax_top_plugin.py").write_text("import nested_syntax_plugin  # noqa\n")
    with pytest.raises(PluginError) as e:
        plugins.load_module("syntax_top_plugin")
    assert str(e.value) == ("--import syntax_top_plugin: nested_syntax_plugin.py:5: SyntaxError: "
                            "invalid syntax")


def test_a_package_folder_imports_by_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    package = tmp_path / "path_pkg_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("from . import part\nVALUE = part.HALF * 2\n")
    (package / "part.py").write_text("HALF = 21\n")
    module = plugins.load_module("./path_pkg_plugin/")
    assert module.VALUE == 42 and sys.modules["path_pkg_plugin"] is module
    assert plugins.load_module(str(package)) is module  # one module, however it is named

    (tmp_path / "plain_folder").mkdir()
    with pytest.raises(PluginError) as e:
        plugins.load_module("./plain_folder")
    assert str(e.value) == ("--import ./plain_folder: a folder without __init__.py; a module "
                            "is a .py file, a package folder (holding __init__.py) or a dotted "
                            "module name")


def test_a_spec_that_is_no_module_says_what_a_module_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x\n")
    for spec in ("notes.txt", "./notes.txt"):
        with pytest.raises(PluginError) as e:
            plugins.load_module(spec)
        assert str(e.value) == (f"--import {spec}: not a .py file; a module is a .py file, a "
                                "package folder (holding __init__.py) or a dotted module name")
    with pytest.raises(PluginError) as e:
        plugins.load_module("my-plugin")
    assert str(e.value) == ("--import my-plugin: not a module name; a module is a .py file, a "
                            "package folder (holding __init__.py) or a dotted module name")


def test_a_failing_module_is_no_usage_error(tmp_path, capsys):
    """No "(see PROG --help)": the command line is right, the module is not."""
    import argparse

    bad = tmp_path / "usage_plugin.py"
    bad.write_text("raise RuntimeError('boom')\n")
    want = f"--import {bad}: {bad.resolve()}:1: RuntimeError: boom"
    # `python -m jaxsim` commands: raised, for run_command's one line.
    parser = cli_io.add_import_flag(argparse.ArgumentParser(prog="python -m jaxsim x"))
    with cli_io.usage_errors_as_exceptions(), pytest.raises(PluginError) as e:
        parser.parse_args(["--import", str(bad)])
    assert str(e.value) == want
    # train.py and eval.py: printed, exit 1.
    parser = cli_io.add_import_flag(cli_io.ArgumentParser(prog="train.py"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--import", str(bad)])
    assert e.value.code == 1 and capsys.readouterr().err == f"error: {want}\n"


def test_environment_and_entry_points(tmp_path, monkeypatch):
    (tmp_path / "env_plugin_a.py").write_text("LOADED = 'a'\n")
    (tmp_path / "env_plugin_b.py").write_text("raise ImportError('needs faiss')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mods = plugins.load_plugins(environ={"JAXSIM_PLUGINS": "env_plugin_a, "}, entry_points=False)
    assert [m.LOADED for m in mods] == ["a"]
    with pytest.raises(PluginError) as e:
        plugins.load_plugins(environ={"JAXSIM_PLUGINS": "env_plugin_a,env_plugin_b"},
                             entry_points=False)
    where = f"{(tmp_path / 'env_plugin_b.py').resolve()}:1"
    assert str(e.value) == f"JAXSIM_PLUGINS env_plugin_b: {where}: ImportError: needs faiss"

    # An installed distribution declaring a `jaxsim.plugins` entry point.
    (tmp_path / "ep_plugin.py").write_text(
        "from jaxsim.objectives import register_objective\n"
        "@register_objective('plug_ep_objective', views=1)\n"
        "def loss(z):\n    return (z ** 2).mean(), {}\n")
    dist = tmp_path / "users_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: users-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[jaxsim.plugins]\nmine = ep_plugin\n")
    from jaxsim.objectives import OBJECTIVES
    assert "plug_ep_objective" not in OBJECTIVES
    plugins.load_plugins(environ={})
    assert "plug_ep_objective" in OBJECTIVES and OBJECTIVES.origin("plug_ep_objective") == \
        "ep_plugin"
    (dist / "entry_points.txt").write_text("[jaxsim.plugins]\nbad = ep_missing_module\n")
    with pytest.raises(PluginError, match="^jaxsim.plugins entry point bad \\(ep_missing_module\\)"
                                          ": ModuleNotFoundError"):
        plugins.load_plugins(environ={})


def test_the_documented_example_module_is_the_page_and_registers_its_four_names():
    page = (REPO / "docs" / "extending.md").read_text()
    example = (REPO / "examples" / "my_research.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 4
    for block in blocks:
        body = "\n".join(line for line in block.splitlines()
                         if not line.startswith(("import ", "from ")))
        assert body.strip() in example
    plugins.load_module(str(REPO / "examples" / "my_research.py"))
    from jaxsim.flows import FLOW_LAYERS
    from jaxsim.models.poolers import POOLERS
    from jaxsim.objectives import OBJECTIVES
    assert ("my_infonce" in OBJECTIVES and "scaled_mean" in POOLERS
            and "diag_affine" in FLOW_LAYERS and OBJECTIVES.origin("my_infonce") == "my_research")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 5)) @ rng.standard_normal((5, 5))
    z = calibrate.fit("shrinkw:0.0", x).apply(x)  # no shrinkage: plain whitening
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(5), atol=1e-8)
    z = calibrate.fit("shrinkw:0.5", x).apply(x)
    assert np.abs(np.cov(z, rowvar=False) - np.eye(5)).max() > 0.05  # shrunk: not white


def test_imports_on_a_command_line():
    assert plugins.imports_in(["--model", "m", "--import", "a", "--import=b.py", "--",
                               "--import", "c"]) == ["a", "b.py"]
    assert plugins.imports_in(["--import"]) == []  # the parser reports the missing value


def test_an_abbreviated_flag_loads_too(tmp_path):
    import argparse

    (tmp_path / "abbrev_plugin.py").write_text("VALUE = 41 + 1\n")
    parser = cli_io.add_import_flag(argparse.ArgumentParser())
    args = parser.parse_args(["--imp", str(tmp_path / "abbrev_plugin.py")])
    assert args.imports == [str(tmp_path / "abbrev_plugin.py")]
    assert sys.modules["abbrev_plugin"].VALUE == 42


def test_every_command_takes_import():
    import importlib

    from jaxsim.cli.main import COMMANDS
    parsers = {name: getattr(importlib.import_module(fn.__module__), f"{name}_parser")
               for name, fn in COMMANDS.items()}
    for name, make in parsers.items():
        assert "--import" in make()._option_string_actions, name
