"""What --device asks for, checked before anything loads: a device that is not there, or a model
and KV cache that do not fit on it, end the command with one line saying which (DeviceError),
not a traceback at the first request."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from fairway.models.config import LlamaConfig

GIB = 1024 ** 3


class DeviceError(ValueError):
    """The device is missing or too small; the message is one line saying which and what to do
    (a ValueError: the CLI prints those as one line)."""


def check_device(device: str) -> torch.device:
    """The torch device for --device, or DeviceError: not a device, a CPU-only torch, no CUDA
    device visible, an index past the devices there are, or no triton (the GPU path's kernels)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {device!r} is not a device: cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"--device {device}: Fairway runs on cpu or cuda, not {dev.type}")
    if torch.version.cuda is None:
        raise DeviceError(f"--device {device}: torch {torch.__version__} is a CPU-only build; install a CUDA "
                          f"build of torch {torch.__version__.split('+')[0]} (pytorch.org/get-started) or use --device cpu")
    count = torch.cuda.device_count()
    if count == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them" if hidden is not None else "no GPU or no NVIDIA driver"
        raise DeviceError(f"--device {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA "
                          f"device ({why})")
    if dev.index is not None and dev.index >= count:
        raise DeviceError(f"--device {device}: there {'is' if count == 1 else 'are'} {count} CUDA "
                          f"device{'' if count == 1 else 's'} (cuda:0..cuda:{count - 1})")
    if importlib.util.find_spec("triton") is None:
        raise DeviceError(f"--device {device}: the GPU path's kernels need triton (pip install triton==3.7.1; "
                          "torch's CUDA wheels bring it)")
    return dev


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on the card: the weights (resident), the KV cache asked for, and what a step needs
    beyond them (activations, the sampler's [rows, vocab] tensors, the recorded graphs' pool)."""

    weights: int
    kv_cache: int
    workspace: int
    free: int  # free on the card before the KV cache is allocated (the weights already are)
    total: int
    kv_blocks: int
    kv_block_bytes: int

    def check(self, card: str) -> None:
        need = self.kv_cache + self.workspace
        if need <= self.free:
            return
        fit = max(0, (self.free - self.workspace) // self.kv_block_bytes)
        raise DeviceError(
            f"{card} ({_gib(self.total)} GiB, {_gib(self.free)} GiB free after the model's {_gib(self.weights)} GiB "
            f"of weights) cannot hold the KV cache of {self.kv_blocks} blocks ({_gib(self.kv_cache)} GiB) and "
            f"{_gib(self.workspace)} GiB of working memory: at most {fit} KV blocks fit; ask for fewer "
            f"(num_kv_blocks) or a smaller model or dtype")


def kv_block_bytes(cfg: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * torch.empty(0, dtype=dtype).element_size()


def workspace_bytes(cfg: LlamaConfig, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """A generous bound on a step's transient memory: the sampler's float32 and float64 copies of
    [rows, vocab] (about 6 of 4 bytes a logit) and a prefill step's activations (the widest
    layer's output, a few times over, in float32), plus 1 GiB for CUDA's and the graphs' own."""
    logits = 6 * 4 * max_num_seqs * cfg.vocab_size
    widest = max(2 * cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size, cfg.vocab_size // 8)
    activations = 4 * 4 * max_num_batched_tokens * widest
    return logits + activations + GIB


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def cuda_memory_plan(model: torch.nn.Module, cfg: LlamaConfig, num_blocks: int, block_size: int,
                     kv_dtype: torch.dtype, max_num_seqs: int, max_num_batched_tokens: int,
                     device: torch.device) -> MemoryPlan:
    """The plan for a model already on the card, before its KV cache is allocated."""
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    free, total = torch.cuda.mem_get_info(device)
    block = kv_block_bytes(cfg, block_size, kv_dtype)
    return MemoryPlan(weights=weights, kv_cache=num_blocks * block,
                      workspace=workspace_bytes(cfg, max_num_seqs, max_num_batched_tokens), free=free,
                      total=total, kv_blocks=num_blocks, kv_block_bytes=block)
