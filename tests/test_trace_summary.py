"""scripts/megatron_deepspeed.py trace: the summary of a torch.profiler trace that
scripts/gpu_megatron_deepspeed.sh prints with PROFILE=START,END. On a real CPU trace (with stacks, as
Megatron-DeepSpeed's --profile pt-full writes it): the profiled steps are counted once, host time is
given to the package of the Python code that asked for it, and a second thread's work (a data loader's)
is left out of the training thread's time."""
import importlib.util
import os
import threading

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORK = "import torch\n\n\ndef work(n):\n    x = torch.ones(64)\n    for _ in range(n):\n        x = x.add(1)\n    return x\n"


def test_trace_summary(tmp_path, capsys):
    script = _load("megatron_deepspeed_script", os.path.join(ROOT, "scripts", "megatron_deepspeed.py"))
    fakes = {}
    for pkg in ("deepspeed", "megatron"):  # files whose paths name the packages the summary sorts by
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "busy.py").write_text(WORK)
        fakes[pkg] = _load(f"fake_{pkg}_busy", str(tmp_path / pkg / "busy.py"))
    stop = threading.Event()

    def loader():  # another thread, busy all along: not the training thread's time
        while not stop.is_set():
            fakes["megatron"].work(20)

    trace_dir = tmp_path / "trace"
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
    thread = threading.Thread(target=loader)
    thread.start()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule, with_stack=True,
                                    on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir), use_gzip=True)) as prof:
            for _ in range(4):  # one warm-up step, three profiled
                fakes["deepspeed"].work(200)
                prof.step()
    finally:
        stop.set()
        thread.join()
    script.trace([str(trace_dir), str(tmp_path / "none")])
    out = capsys.readouterr().out
    assert "3 profiled steps" in out
    packages = out.split("by package")[1].split("CUDA calls (ms")[0]
    assert "deepspeed" in packages and "ATen ops" in packages
    assert "megatron" not in out  # the other thread's code
    line = next(s for s in out.splitlines() if "deepspeed/busy.py" in s and "work" in s)
    assert float(line.split()[1]) == 1.0  # one call a step
    add = next(s for s in out.splitlines() if "built-in method add" in s)
    assert float(add.split()[1]) == 200.0  # 200 calls a step, counted once per step
    assert f"== {tmp_path / 'none'}: no trace" in out
