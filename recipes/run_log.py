"""What a training run reports, from rank 0: a JSONL log (always), wandb (offline unless a key is
configured), and a progress bar with tokens/s, loss, learning rate, aux loss, expert load and MFU."""
import json
import netrc
import os
import time
from typing import Optional

import torch
from tqdm import tqdm

# Dense bf16 tensor-core peak per GPU, TFLOP/s, by a substring of torch.cuda.get_device_name(); the first
# match wins, so a variant comes before its family's name (H100 NVL: 1,671 TFLOP/s with 2:4 sparsity).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
                    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A10G", 70.0))

LOG_FILE = "log.jsonl"  # in log.dir: a JSON record a line, appended by a resumed run


def peak_flops(configured_tflops: Optional[float], on_gpu: bool) -> Optional[float]:
    """Per-device peak FLOP/s for MFU: the configured one, else known from the GPU; None on the CPU."""
    if configured_tflops:
        return configured_tflops * 1e12
    if not on_gpu:
        return None
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def wandb_key_configured() -> bool:
    """WANDB_API_KEY, or the ~/.netrc entry that `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class RunLog:
    def __init__(self, cfg, start_step: int, enabled: bool, resumed_from: Optional[str], launch: Optional[str] = None):
        self.enabled = enabled
        self.bar = self.wandb = self.jsonl = None
        if not enabled:
            return
        os.makedirs(cfg.log.dir, exist_ok=True)
        self.jsonl = open(os.path.join(cfg.log.dir, LOG_FILE), "a")
        self.write({"type": "start", "step": start_step, "resumed_from": resumed_from, "launch": launch,
                    "time": time.time()})
        if cfg.log.wandb:
            import wandb
            # wandb.init's mode wins over WANDB_MODE: the user's environment comes before the key's default.
            mode = (cfg.log.wandb_mode or os.environ.get("WANDB_MODE")
                    or ("online" if wandb_key_configured() else "offline"))
            self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.name, dir=cfg.log.dir, mode=mode,
                                    config=cfg.to_dict())
        self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc=cfg.name, dynamic_ncols=True,
                        mininterval=2.0)

    def write(self, record: dict):
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.wandb is not None and record["type"] in ("train", "valid"):
            prefix = record["type"] + "/"
            self.wandb.log({prefix + k: v for k, v in record.items() if isinstance(v, (int, float))
                            and k not in ("type", "step")}, step=record["step"])

    def train_step(self, record: dict):
        if not self.enabled:
            return
        self.write(record)
        post = {"loss": f"{record['loss']:.3f}", "lr": f"{record['lr']:.2e}", "aux": f"{record['aux_loss']:.3f}",
                "load": f"{record['expert_load']:.2f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
        if record.get("mfu") is not None:
            post["mfu"] = f"{100 * record['mfu']:.1f}%"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def message(self, text: str):
        if self.enabled:
            (self.bar.write if self.bar else print)(text)

    def close(self):
        if not self.enabled:
            return
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.jsonl.close()
