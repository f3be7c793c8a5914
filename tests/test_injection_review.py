"""Review of how turbomoe enters DeepSpeed / Megatron-DeepSpeed without editing their source:
turbomoe/integrations/run_with_turbomoe.py, _sitecustomize/sitecustomize.py, deepspeed.py's
patch() / unpatch() / is_patched(), and the README's "DeepSpeed" / "Megatron-DeepSpeed" promises.

Not duplicated here: test_deepspeed_fidelity.py::test_patch_swaps_stock_layer_for_unmodified_code
(patch / unpatch once), test_deepspeed_launcher.py (2-rank train / save / resume through both
routes). Subprocess tests run one CPU process each (DS_ACCELERATOR=cpu); no GPU.

Six faults this review found are fixed (the hook's folder on PYTHONPATH under two names recursing,
TURBOMOE_PATCH_DEEPSPEED and TURBOMOE_FUSED_GRAD_ACCUMULATION values other than 0 / 1 ignored
silently, a leading `--` passed to the script, a symlinked script's sys.path[0], workers the script
spawns left on stock DeepSpeed), and a seventh later (is_patched() after the module's reload); the
xfail(strict) test records a known limit.
"""
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
import deepspeed.moe.layer as ds_layer  # noqa: E402

import turbomoe.integrations as integrations  # noqa: E402
import turbomoe.integrations.deepspeed as tds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SC = integrations.SITECUSTOMIZE_DIR
M, E = 8, 4

# Prints what the script sees, as JSON on one line prefixed with PROBE.
PROBE = textwrap.dedent("""\
    import json, os, sys
    from torch import nn
    import deepspeed.moe.layer as L
    import turbomoe.integrations.deepspeed as tds
    m = L.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, k=1)
    info = dict(argv=sys.argv, name=__name__, path0=sys.path[0], patched=tds.is_patched(),
                layer=type(m).__module__, inner=type(m.deepspeed_moe).__name__,
                inner_mro=[c.__name__ for c in type(m.deepspeed_moe).__mro__],
                shadow=os.environ.get("SHADOW_RAN_COUNT_FILE") and open(os.environ["SHADOW_RAN_COUNT_FILE"]).read())
    print("PROBE " + json.dumps(info), flush=True)
    if __name__ == "__main__" and sys.argv[-1].startswith("exit="):
        sys.exit(int(sys.argv[-1][5:]))
    if __name__ == "__main__" and sys.argv[-1] == "raise":
        def inner_fn():
            raise ValueError("raised in the user's script")
        inner_fn()
""")


def base_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TURBOMOE_PATCH_DEEPSPEED", "TURBOMOE_FUSED_GRAD_ACCUMULATION", "PYTHONPATH")}
    env.update(PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.update(extra)
    return env


def run_py(args, env, cwd=ROOT, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def probe(proc):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert lines, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(lines[-1][len("PROBE "):])


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "user_dir" / "train.py"
    path.parent.mkdir()
    path.write_text(PROBE)
    return str(path)


def _mlp():
    return nn.Sequential(nn.Linear(M, 2 * M), nn.GELU(), nn.Linear(2 * M, M))


@pytest.fixture
def unpatched():
    was = tds.is_patched()
    tds.unpatch()
    yield
    tds.patch() if was else tds.unpatch()


# --------------------------------------------------------------------------------------------
# run_with_turbomoe: what it promises and keeps
# --------------------------------------------------------------------------------------------

def test_run_with_turbomoe_runs_the_script_as_python_would(script):
    """argv (spaces, quotes, '=' values, the launcher's --local_rank before the script's own), __name__,
    sys.path[0], the exit code of sys.exit and the user's traceback, as `python train.py ARGS`."""
    args = ["a b", "--q=x 'y' \"z\"", "--n", "3", ""]
    plain = probe(run_py([script, "--local_rank=0", *args], base_env()))
    turbo = probe(run_py(["-m", "turbomoe.integrations.run_with_turbomoe", "--local_rank=0", script, *args],
                         base_env()))
    assert turbo["argv"] == plain["argv"] == [script, "--local_rank=0", *args]
    assert turbo["name"] == plain["name"] == "__main__"
    assert turbo["path0"] == plain["path0"] == os.path.dirname(script)
    assert not plain["patched"] and plain["layer"] == "deepspeed.moe.layer"
    assert turbo["patched"] and turbo["layer"] == "turbomoe.integrations.deepspeed"
    assert turbo["inner"] == "TurboMOELayer" and turbo["inner_mro"].count("TurboMOELayer") == 1

    proc = run_py(["-m", "turbomoe.integrations.run_with_turbomoe", script, "exit=7"], base_env())
    assert proc.returncode == 7
    proc = run_py(["-m", "turbomoe.integrations.run_with_turbomoe", script, "raise"], base_env())
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert err[-1] == "ValueError: raised in the user's script"
    assert f'File "{script}"' in proc.stderr and "in inner_fn" in proc.stderr


def test_run_with_turbomoe_refuses_missing_script(tmp_path):
    proc = run_py(["-m", "turbomoe.integrations.run_with_turbomoe", str(tmp_path / "nope.py"), "--x"], base_env())
    assert proc.returncode != 0 and "no such script" in proc.stderr
    proc = run_py(["-m", "turbomoe.integrations.run_with_turbomoe", "--local_rank=0"], base_env())
    assert proc.returncode != 0 and "usage" in proc.stderr


def test_deepspeed_launcher_module_route_passes_args_and_exit_code(script):
    """`deepspeed --num_gpus 1 --module turbomoe.integrations.run_with_turbomoe train.py ARGS`: the
    rank's argv as the launcher gives a plain script, its exit code back from the launcher."""
    from launching import free_port
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "1", "--master_port", str(free_port()), "--module",
           "turbomoe.integrations.run_with_turbomoe", script, "a b", "--q=x y", "exit=5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=120)
    info = probe(proc)
    assert info["argv"] == [script, "--local_rank=0", "a b", "--q=x y", "exit=5"]
    assert info["patched"] and info["inner"] == "TurboMOELayer"
    assert proc.returncode == 5


def test_end_of_options_marker_is_not_passed_to_the_script(script):
    info = probe(run_py(["-m", "turbomoe.integrations.run_with_turbomoe", "--", script, "--x=1"], base_env()))
    assert info["argv"] == [script, "--x=1"]


def test_symlinked_script_gets_the_same_sys_path_as_python(tmp_path, script):
    links = tmp_path / "links"
    links.mkdir()
    os.symlink(script, links / "train.py")
    link = str(links / "train.py")
    plain = probe(run_py([link], base_env()))
    turbo = probe(run_py(["-m", "turbomoe.integrations.run_with_turbomoe", link], base_env()))
    assert plain["path0"] == os.path.dirname(script)  # python resolves it
    assert turbo["path0"] == plain["path0"]


SPAWN = textwrap.dedent("""\
    import multiprocessing as mp
    from torch import nn

    def work(q):
        import deepspeed.moe.layer as L
        q.put(type(L.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, k=1)).__module__)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=work, args=(q, ))
        p.start()
        child = q.get(timeout=100)
        p.join()
        import deepspeed.moe.layer as L
        parent = type(L.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, k=1)).__module__
        print("LAYERS", parent, child, flush=True)
""")


def test_workers_spawned_by_the_script_get_turbomoe(tmp_path):
    path = tmp_path / "spawning.py"
    path.write_text(SPAWN)
    proc = run_py(["-m", "turbomoe.integrations.run_with_turbomoe", str(path)], base_env())
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("LAYERS ")]
    assert line, proc.stderr[-3000:]
    parent, child = line[0].split()[1:]
    assert parent == "turbomoe.integrations.deepspeed"
    assert child == "turbomoe.integrations.deepspeed"


# --------------------------------------------------------------------------------------------
# sitecustomize route
# --------------------------------------------------------------------------------------------

def test_sitecustomize_runs_the_shadowed_one_and_patches_once(tmp_path, script):
    """The hook hands over to the sitecustomize it shadows (once), patches, and together with
    run_with_turbomoe (patch() twice) still builds one TurboMOELayer; without the variable, or =0, no patch."""
    other = tmp_path / "other_site"
    other.mkdir()
    count = tmp_path / "count.txt"
    count.write_text("")
    (other / "sitecustomize.py").write_text(
        "import os\nopen(os.environ['SHADOW_RAN_COUNT_FILE'], 'a').write('x')\n")
    pp = os.pathsep.join([SC, str(other), ROOT])
    env = base_env(PYTHONPATH=pp, TURBOMOE_PATCH_DEEPSPEED="1", SHADOW_RAN_COUNT_FILE=str(count))
    info = probe(run_py([script], env))
    assert info["patched"] and info["inner"] == "TurboMOELayer" and info["shadow"] == "x"
    count.write_text("")
    info = probe(run_py(["-m", "turbomoe.integrations.run_with_turbomoe", script], env))
    assert info["patched"] and info["inner_mro"].count("TurboMOELayer") == 1 and info["shadow"] == "x"
    for value in (None, "0"):
        count.write_text("")
        env2 = dict(env)
        env2.pop("TURBOMOE_PATCH_DEEPSPEED")
        if value is not None:
            env2["TURBOMOE_PATCH_DEEPSPEED"] = value
        info = probe(run_py([script], env2))
        assert not info["patched"] and info["layer"] == "deepspeed.moe.layer" and info["shadow"] == "x"


def test_sitecustomize_folder_twice_on_pythonpath_still_patches(tmp_path, script):
    link = tmp_path / "sc_link"
    os.symlink(SC, link)
    env = base_env(PYTHONPATH=os.pathsep.join([SC, str(link), ROOT]), TURBOMOE_PATCH_DEEPSPEED="1")
    proc = run_py([script], env)
    assert "RecursionError" not in proc.stderr
    assert probe(proc)["patched"]


@pytest.mark.parametrize("value", ["true"])
def test_patch_variable_other_values_patch_or_are_refused(script, value):
    env = base_env(PYTHONPATH=os.pathsep.join([SC, ROOT]), TURBOMOE_PATCH_DEEPSPEED=value)
    proc = run_py([script], env)
    refused = "TURBOMOE_PATCH_DEEPSPEED" in proc.stderr
    assert refused or probe(proc)["patched"], proc.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# patch() / unpatch() / is_patched(), in this process
# --------------------------------------------------------------------------------------------

def _build(seed=0, **kw):
    torch.manual_seed(seed)
    layer = ds_layer.MoE(hidden_size=M, expert=_mlp(), num_experts=E, k=2, **kw)
    return layer, torch.rand(4)  # the generator after construction


def test_patch_twice_builds_one_layer_with_stocks_state_and_unpatch_restores(unpatched):
    stock, rng_stock = _build()
    tds.patch()
    tds.patch()  # sitecustomize + run_with_turbomoe + the user's own call
    assert tds.is_patched()
    turbo, rng_turbo = _build()
    assert type(turbo) is tds.MoE and type(turbo.deepspeed_moe) is tds.TurboMOELayer
    assert isinstance(turbo, ds_layer.MoE)
    # the same modules (none nested twice), the same state dict keys, shapes and values, the same draws
    assert [n for n, _ in stock.named_modules()] == [n for n, _ in turbo.named_modules()]
    sd_s, sd_t = stock.state_dict(), turbo.state_dict()
    assert list(sd_s) == list(sd_t)
    for key in sd_s:
        assert sd_s[key].shape == sd_t[key].shape and torch.equal(sd_s[key], sd_t[key]), key
    assert torch.equal(rng_stock, rng_turbo)
    # a torch.save round trip of the whole state dict loads into stock
    buf = io.BytesIO()
    torch.save(sd_t, buf)
    buf.seek(0)
    back, _ = _build(seed=1)
    tds.unpatch()
    assert not tds.is_patched()
    stock2, _ = _build(seed=1)
    assert type(stock2) is ds_layer.MoE and type(stock2.deepspeed_moe).__name__ == "MOELayer"
    stock2.load_state_dict(torch.load(buf))
    x = torch.randn(16, M)
    stock.eval(), stock2.eval()
    torch.testing.assert_close(stock(x)[0], stock2(x)[0])
    tds.unpatch()  # twice: still stock, constructor arguments still taken
    assert type(_build()[0]) is ds_layer.MoE


def test_patch_leaves_subclasses_and_keeps_stocks_signature(unpatched):
    import inspect
    stock_params = list(inspect.signature(tds.StockMoE.__init__).parameters.values())
    turbo_params = list(inspect.signature(tds.MoE.__init__).parameters.values())
    assert [(p.name, p.default) for p in stock_params] == [(p.name, p.default) for p in turbo_params[:len(stock_params)]]

    class Sub(ds_layer.MoE):
        pass
    tds.patch()
    try:
        # positional, as Megatron-DeepSpeed passes some of them
        layer = ds_layer.MoE(M, _mlp(), E, 1, 2, 1.0, 1.0, 4, False, None, True, True, False, False, True)
        assert type(layer) is tds.MoE and layer.deepspeed_moe.gate.k == 2
        assert type(Sub(M, _mlp(), E, k=2)) is Sub
    finally:
        tds.unpatch()


RELOAD = textwrap.dedent("""\
    import importlib
    from torch import nn
    import deepspeed.moe.layer as L
    import turbomoe.integrations.deepspeed as tds
    tds.patch()
    importlib.reload(tds)
    print("RELOAD", tds.is_patched(), flush=True)
    tds.unpatch()
    m = L.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, k=1)
    print("RELOAD", type(m).__module__, flush=True)
""")


def test_unpatch_after_module_reload(tmp_path):
    """After importlib.reload of the integration (a new _new_turbomoe function) is_patched() still sees
    the patch, and unpatch() undoes it."""
    path = tmp_path / "reload.py"
    path.write_text(RELOAD)
    proc = run_py([str(path)], base_env())
    out = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("RELOAD ")]
    assert len(out) == 2, proc.stderr[-2000:]
    assert out == ["True", "deepspeed.moe.layer"]


# --------------------------------------------------------------------------------------------
# environment variables of the drop-in and checkpoint files
# --------------------------------------------------------------------------------------------

def test_fused_grad_accumulation_variable_other_values_refused(monkeypatch):
    monkeypatch.setenv("TURBOMOE_FUSED_GRAD_ACCUMULATION", "true")
    try:
        layer = tds.MoE(hidden_size=M, expert=_mlp(), num_experts=E, k=2)
    except ValueError as e:
        assert "TURBOMOE_FUSED_GRAD_ACCUMULATION" in str(e)
        return
    assert layer.deepspeed_moe.fused_grad_accumulation


def test_fused_grad_accumulation_variable_one_and_zero(monkeypatch):
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv("TURBOMOE_FUSED_GRAD_ACCUMULATION", value)
        assert tds.MoE(hidden_size=M, expert=_mlp(), num_experts=E, k=2).deepspeed_moe.fused_grad_accumulation is want


@pytest.mark.xfail(strict=True, reason=(
    "known limit, not fixed (DeepSpeed's own expert checkpoints clone each expert): deepspeed.py:76 "
    "(pack_expert_params, expert_stack.py:240-247) makes every expert's parameters views "
    "of one flat buffer: torch.save of one expert's state dict writes all local experts' weights "
    "(here 6377 vs stock's 3357 bytes at E=4; stock without ZeRO keeps each expert's own storage)"))
def test_one_experts_state_dict_saves_like_stocks(unpatched):
    sizes = {}
    for cls in (ds_layer.MoE, tds.MoE):
        torch.manual_seed(0)
        layer = cls(hidden_size=M, expert=_mlp(), num_experts=E, k=2)
        buf = io.BytesIO()
        torch.save(layer.deepspeed_moe.experts.deepspeed_experts[0].state_dict(), buf)
        sizes[cls] = len(buf.getvalue())
    assert sizes[tds.MoE] <= sizes[ds_layer.MoE] * 1.1, sizes
