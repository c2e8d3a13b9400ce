"""--device cuda where it cannot work, and a KV cache that does not fit the card: one line saying
which, at start (fairway/engine/device.py). This machine's torch is a CPU-only build; the other
cases are faked."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fairway.cli import main
from fairway.engine.device import GIB, DeviceError, MemoryPlan, check_device, kv_block_bytes, workspace_bytes
from fairway.engine.factory import build_engine
from fairway.models.config import LlamaConfig

# Llama-3.2-1B's shape.
LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, max_position_embeddings=131072)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_a_cpu_only_torch_is_one_line_at_start(capsys):
    assert main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CPU-only build" in err[0] and torch.__version__ in err[0]
    with pytest.raises(DeviceError, match="CPU-only build"):
        build_engine(device="cuda")  # the library's entry says the same, before loading weights


@pytest.fixture
def cuda_build(monkeypatch):
    """A CUDA build of torch, with as many devices as the test sets."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    count = [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count[0])
    return count


def test_no_visible_device_says_why(cuda_build, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceError, match="sees no CUDA device .no GPU or no NVIDIA driver"):
        check_device("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES='' hides them"):
        check_device("cuda")


def test_an_index_past_the_devices(cuda_build):
    cuda_build[0] = 2
    with pytest.raises(DeviceError, match=r"there are 2 CUDA devices \(cuda:0..cuda:1\)"):
        check_device("cuda:2")


def test_no_triton_on_a_cuda_build(cuda_build, monkeypatch):
    cuda_build[0] = 1
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(DeviceError, match="need triton"):
        check_device("cuda:0")


def test_not_a_device():
    with pytest.raises(DeviceError, match="'gpu' is not a device"):
        check_device("gpu")
    assert check_device("cpu") == torch.device("cpu")


def test_a_kv_cache_too_large_for_the_card_names_the_sizes():
    block = kv_block_bytes(LLAMA_1B, 16, torch.bfloat16)
    assert block == 2 * 16 * 8 * 64 * 16 * 2  # K and V, 16 layers, 8 KV heads, 64 dims, 16 tokens, 2 bytes
    workspace = workspace_bytes(LLAMA_1B, 256, 512)
    plan = MemoryPlan(weights=int(2.47 * GIB), kv_cache=200_000 * block, workspace=workspace, free=20 * GIB,
                      total=24 * GIB, kv_blocks=200_000, kv_block_bytes=block)
    fit = (20 * GIB - workspace) // block
    with pytest.raises(DeviceError) as err:
        plan.check("NVIDIA L4")
    message = str(err.value)
    assert "\n" not in message
    for part in ("NVIDIA L4 (24.00 GiB, 20.00 GiB free after the model's 2.47 GiB of weights)",
                 f"KV cache of 200000 blocks ({200_000 * block / GIB:.2f} GiB)",
                 f"{workspace / GIB:.2f} GiB of working memory", f"at most {fit} KV blocks fit"):
        assert part in message
    MemoryPlan(weights=plan.weights, kv_cache=fit * block, workspace=workspace, free=20 * GIB, total=24 * GIB,
               kv_blocks=fit, kv_block_bytes=block).check("NVIDIA L4")  # what it says fits, fits


def test_serving_imports_no_triton():
    """triton is a test extra: the engine, the GPU runner's module included, imports it only when a
    GPU runner is built (make serve installs no triton)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, fairway.engine.factory, fairway.engine.gpu_model_runner, fairway.assembly; "
            "print('triton' in sys.modules)")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
