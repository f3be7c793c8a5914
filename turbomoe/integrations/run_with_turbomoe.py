"""Run a training script with DeepSpeed's MoE swapped for turbomoe's, without editing the script.

    python -m turbomoe.integrations.run_with_turbomoe train.py --args ...
    deepspeed --num_gpus 8 --module turbomoe.integrations.run_with_turbomoe pretrain_gpt.py --args ...

Calls turbomoe.integrations.deepspeed.patch(), then runs the script as `python train.py --args`
would: as __main__, with sys.argv[0] the script and its folder (a link resolved) first on sys.path.
Python processes the script starts (multiprocessing's spawned workers, say) are patched the same way,
through the environment they inherit: TURBOMOE_PATCH_DEEPSPEED=1 and the sitecustomize folder on
PYTHONPATH (the hook's route).
"""
import os
import runpy
import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # deepspeed's launcher with --module puts its own options (--local_rank=N) before the script
    # name; `python script.py` under the launcher gets them as the script's first arguments.
    num_opts = next((i for i, a in enumerate(argv) if not a.startswith("-") or a == "--"), len(argv))
    launcher_opts, argv = argv[:num_opts], argv[num_opts:]
    if argv[:1] == ["--"]:  # the end of options: the script comes next
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m turbomoe.integrations.run_with_turbomoe SCRIPT.py [script args ...]")
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"run_with_turbomoe: no such script: {script}")
    from . import SITECUSTOMIZE_DIR
    from .deepspeed import patch
    patch()
    os.environ["TURBOMOE_PATCH_DEEPSPEED"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITECUSTOMIZE_DIR, os.environ.get("PYTHONPATH")) if p)
    sys.argv = [script] + launcher_opts + argv[1:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
