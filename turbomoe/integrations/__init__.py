"""Drop-in integrations with training frameworks: `turbomoe.integrations.deepspeed` (DeepSpeed and
Megatron-DeepSpeed). Each is imported on its own, so turbomoe does not need the framework installed."""
