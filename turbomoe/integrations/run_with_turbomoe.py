"""Run a training script with DeepSpeed's MoE swapped for turbomoe's, without editing the script.

    python -m turbomoe.integrations.run_with_turbomoe train.py --args ...
    deepspeed --num_gpus 8 --module turbomoe.integrations.run_with_turbomoe pretrain_gpt.py --args ...

Calls turbomoe.integrations.deepspeed.patch(), then runs the script as `python train.py --args`
would: as __main__, with sys.argv[0] the script and its folder first on sys.path.
"""
import os
import runpy
import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # deepspeed's launcher with --module puts its own options (--local_rank=N) before the script
    # name; `python script.py` under the launcher gets them as the script's first arguments.
    num_opts = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    launcher_opts, argv = argv[:num_opts], argv[num_opts:]
    if not argv:
        raise SystemExit("usage: python -m turbomoe.integrations.run_with_turbomoe SCRIPT.py [script args ...]")
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"run_with_turbomoe: no such script: {script}")
    from .deepspeed import patch
    patch()
    sys.argv = [script] + launcher_opts + argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
