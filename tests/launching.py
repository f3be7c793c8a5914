"""Launching multi-process tests: a free port, and the deepspeed launcher on CPU (gloo) or GPU ranks.

Every launched rank runs with PYTHONFAULTHANDLER=1, so a rank that dies of a signal prints the
Python stack of each of its threads. A launch where a rank died of a signal (SIGABRT from C++
code, e.g. "terminate called without an active exception" once in CI in torch 2.13's gloo, not
reproduced in 22 local runs) is run once more, with a warning that carries the first output: a
crash that repeats still fails, and a Python error or a wrong result (exit code 1) never reruns.
"""
import os
import shutil
import socket
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLED_BY_SIGNAL = "exits with return code = -"  # the deepspeed launcher's line for a rank's negative exit code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(cpu: bool, **extra) -> dict:
    """os.environ with this tree on PYTHONPATH and the venv's bin on PATH; on `cpu`, CPU ranks even
    where there are GPUs (one thread each: two ranks share CI's two cores)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if cpu:
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


# What a launcher sets for its ranks: a process started without one must not inherit them (an earlier
# test's MASTER_PORT may still be in use)
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def one_rank_env(drop=()) -> dict:
    """launcher_env(cpu=True) for one process started without a launcher: no rank variables, nor drop."""
    return {k: v for k, v in launcher_env(cpu=True).items() if k not in RANK_VARS and k not in drop}


def deepspeed_launch(script, *args, env, nproc=2, launcher_args=(), timeout=300, check=True):
    """`deepspeed --num_gpus nproc [launcher_args] script args` from the repository root; the
    CompletedProcess. check: fail with the output's tail unless it exits 0."""
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    env = dict(env, PYTHONFAULTHANDLER="1")

    def once():
        cmd = [launcher, "--num_gpus", str(nproc), "--master_port", str(free_port()), *launcher_args,
               script, *map(str, args)]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    proc = once()
    if proc.returncode != 0 and KILLED_BY_SIGNAL in proc.stdout + proc.stderr:
        warnings.warn(f"a rank of {os.path.basename(script)} died of a signal; running it once more. "
                      f"First run:\n{tail(proc)}")
        proc = once()
    if check and proc.returncode != 0:
        raise AssertionError(f"launcher exited {proc.returncode}:\n{tail(proc)}")
    return proc


def tail(proc, n=4000) -> str:
    return proc.stdout[-n:] + "\n" + proc.stderr[-n:]
