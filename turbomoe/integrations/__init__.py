"""Drop-in integrations with training frameworks: `turbomoe.integrations.deepspeed` (DeepSpeed and
Megatron-DeepSpeed). Each is imported on its own, so turbomoe does not need the framework installed.

SITECUSTOMIZE_DIR: put it on PYTHONPATH with TURBOMOE_PATCH_DEEPSPEED=1 to patch DeepSpeed in
every process, without editing the script or the launch command.
"""
import os

SITECUSTOMIZE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sitecustomize")
