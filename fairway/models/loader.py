"""Load weights: a GGUF file or a Hugging Face folder.

A GGUF file is dequantized once and cached as safetensors; with weights="native" its Q8_0/Q4_0/Q4_1
linear layers are then swapped for ones that multiply the blocks as stored (quant_linear.py), and
only the rest (norms, the embedding lookup, other types) stays dequantized. weights="auto" (the
default) does the same and, where this CPU has a native bf16 kernel, keeps a bf16 copy for steps
of many rows, which it multiplies faster (quant_linear.dense_from_rows).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from fairway.cache_dir import cache_dir
from fairway.models import huge_pages
from fairway.models.bundled import ModelFileError
from fairway.models.config import LlamaConfig
from fairway.models.llama import LlamaModel, RotaryEmbedding
from fairway.models.packed_linear import PackedLinear, pack_linears, packing_supported
from fairway.models.precision import compute_dtype
from fairway.models.quant_linear import (
    DENSE_FROM_ROWS,
    QuantLinear,
    dense_from_rows,
    native_types,
    pack_blocks,
)
from fairway.models.weights import WEIGHTS

log = logging.getLogger(__name__)

T = TypeVar("T")

DENSE_MEMORY_SHARE = 0.25  # a bf16 copy is kept only if it takes at most this share of the free memory

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", pack: bool = True, weights: str = "auto") -> LlamaModel:
    """A .gguf file or a folder with config.json + *.safetensors, its weights rounded to `dtype`.
    On a CPU without native half-precision matmuls they are then held in float32 (precision.py).
    weights="native": a GGUF's linear layers in a type with a native kernel stay in it, `dtype` then
    only the activations' and the KV cache's; "auto": the same, with a bf16 copy for steps of many
    rows where this CPU multiplies that faster. On CPU the other linear layers are pre-packed for
    oneDNN (pack=False keeps plain nn.Linear)."""
    path = Path(path)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, not {weights!r}")
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist: pass a .gguf file or a Hugging Face folder")
    if path.is_dir():
        config, state = _read_hf_folder(path)
    else:
        config, state = read_gguf_cached(path)
    rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta).to(device)
    with torch.device("meta"):
        model = LlamaModel(config, rotary)
    del model.rotary  # its tables are real already: materializing would empty them
    _materialize(model, torch.device(device))
    if config.tie_word_embeddings:  # each parameter got its own storage: tie again
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = rotary
    model.load_hf_state_dict(state)
    model = model.to(dtype).eval()
    held = compute_dtype(dtype, device)
    if held != dtype:
        model = model.to(held)  # exact: every bf16/fp16 value is a float32 value
        model.kv_cache_dtype = dtype
    if weights in ("auto", "native") and path.is_file() and torch.device(device).type == "cpu":
        use_quantized_linears(model, path, held, dense=weights == "auto")
    if pack and packing_supported(held, torch.device(device)):
        pack_linears(model, bf16_copy=dtype == torch.bfloat16 and held == torch.float32)
        huge_pages.gather(model)  # before the native pass takes the weights' pointers
        model.use_native_decode()
    return model


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Gives each meta parameter and buffer uninitialised storage on device. (nn.Module.to_empty
    does the same through torch's meta-tensor decompositions, and importing them, sympy
    included, took longer than the rest of a load from the cache.)"""
    for mod in model.modules():
        for name, t in mod._parameters.items():
            if t is not None:
                mod._parameters[name] = nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device=device),
                                                     requires_grad=t.requires_grad)
        for name, t in mod._buffers.items():
            if t is not None:
                mod._buffers[name] = torch.empty(t.shape, dtype=t.dtype, device=device)


def gguf_config(reader) -> LlamaConfig:  # reader: gguf.GGUFReader
    def field(name: str, default=None):
        f = reader.fields.get(name)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    if arch != "llama":
        raise ModelFileError(f"unsupported GGUF architecture {arch!r}: Fairway runs Llama-architecture models")
    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    tokens = field("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=int(field("llama.vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=int(field("llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field("llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
    )


def _cached_file(path: Path, suffix: str) -> Path:
    """Where something read from this model file is kept, for this version of the file."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / f"{path.stem}-{key}{suffix}"


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a GGUF file lies, as the gguf reader's view of it."""

    type_name: str  # GGML's: Q4_1, Q8_0, F32, ...
    dtype: str  # numpy's, of the view: uint8 for a block type
    shape: tuple[int, ...]  # of the view: [rows, bytes of a row of blocks] for a block type
    offset: int  # bytes from the file's start

    def array(self, path: Path) -> np.ndarray:
        return np.memmap(path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)


def _remembered(path: Path, suffix: str, read: Callable[[], Any], decode: Callable[[Any], T]) -> T:
    """What read() finds in the model file (JSON), read once, then from the cache folder; a cache
    that cannot be decoded (half written by an interrupted run) is read from the file again."""
    cached = _cached_file(path, suffix)
    if cached.exists():
        try:
            return decode(json.loads(cached.read_text()))
        except Exception:
            pass
    found = read()
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(found))
    tmp.replace(cached)
    return decode(found)


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """The GGUF's tensors, by name: read once, then from the cache folder. To find them the gguf
    reader parses every metadata field (the tokenizer's vocabulary string by string), the slowest
    part of a replica's start when it ran at every start."""

    def read() -> dict[str, list]:
        import gguf

        return {t.name: [t.tensor_type.name, str(t.data.dtype), [int(d) for d in t.data.shape], int(t.data_offset)]
                for t in gguf.GGUFReader(str(path)).tensors}

    return _remembered(path, ".tensors.json", read, lambda layout: {
        name: StoredTensor(kind, dtype, tuple(shape), offset) for name, (kind, dtype, shape, offset) in layout.items()})


def read_config(path: Path) -> LlamaConfig:
    """A model's shape alone, without its weights (a GGUF's metadata, a folder's config.json): what
    the command line checks its options against before the load."""
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist: pass a .gguf file or a Hugging Face folder")
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelFileError(f"model folder {path} needs config.json and *.safetensors files")
        return LlamaConfig.from_hf(json.loads(cfg_file.read_text()))
    # (the gguf reader parses every metadata field: seconds at every start)
    return _remembered(path, ".config.json", lambda: gguf_config(_gguf_reader(path)).__dict__,
                       lambda fields: LlamaConfig(**fields))


def read_gguf_cached(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Dequantize a GGUF once; later loads read the float32 safetensors cache (memory-mapped)."""
    from safetensors.torch import load_file, save_file

    cached = _cached_file(path, ".safetensors")
    meta = cached.with_suffix(".json")
    if cached.exists() and meta.exists():
        try:
            return LlamaConfig(**json.loads(meta.read_text())), load_file(str(cached))
        except Exception:  # a half-written cache from an interrupted run: rebuild it
            pass
    config, state = read_gguf(path)
    tmp = cached.with_suffix(".tmp")
    save_file(state, str(tmp))
    tmp.replace(cached)
    meta.write_text(json.dumps(config.__dict__))
    return config, state


def _gguf_reader(path: Path):  # -> gguf.GGUFReader
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelFileError(f"model file {path} is not a readable GGUF file ({exc}): "
                             "re-download or reinstall it") from exc


def read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = _gguf_reader(path)
    config = gguf_config(reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))  # GGUF lists dims fastest-first
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        name = _hf_name(t.name)
        # llama.cpp's converter permutes Q/K rows for its interleaved RoPE; undo it for rotate-half RoPE.
        if name.endswith("q_proj.weight"):
            values = _unpermute(values, config.num_heads)
        elif name.endswith("k_proj.weight"):
            values = _unpermute(values, config.num_kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
    return config, state


def use_quantized_linears(model: LlamaModel, path: Path, dtype: torch.dtype, dense: bool = False) -> int:
    """Swap each linear layer whose GGUF weight has a native kernel (Q8_0/Q4_0/Q4_1) for a
    QuantLinear on the file's blocks; a fused layer (QKV, gate|up) only when its parts share a type.
    Activations stay in `dtype` (float32 or bf16; others keep the dequantized layers). With dense,
    each keeps its dequantized bf16 weight for the steps of many rows where that multiplies
    faster here (keep_dense_copies). Returns how many."""
    kinds = native_types(dtype)
    if not kinds:
        return 0
    tensors = stored_tensors(path)
    c = model.cfg

    def stored(*names: str) -> tuple[tuple[str, ...], str] | None:
        parts = [tensors.get(name) for name in names]
        types = {p.type_name for p in parts if p is not None}
        if None in parts or len(types) != 1 or not types <= kinds:
            return None
        return names, types.pop()

    swaps: list[tuple[nn.Module, str, tuple[tuple[str, ...], str] | None, int]] = []
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        swaps += [(layer.self_attn, "qkv_proj", stored(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
                   c.hidden_size),
                  (layer.self_attn, "o_proj", stored(p + "attn_output.weight"), c.q_size),
                  (layer.mlp, "gate_up_proj", stored(p + "ffn_gate.weight", p + "ffn_up.weight"), c.hidden_size),
                  (layer.mlp, "down_proj", stored(p + "ffn_down.weight"), c.intermediate_size)]
    head = "token_embd.weight" if c.tie_word_embeddings else "output.weight"
    swaps.append((model, "lm_head", stored(head), c.hidden_size))
    chosen = [(parent, name, found, width) for parent, name, found, width in swaps
              if found is not None and width % 32 == 0]
    panels = PanelCache(path, tensors, c)
    swapped: list[tuple[QuantLinear, torch.Tensor]] = []
    for parent, name, (names, qtype), width in chosen:
        weight = getattr(parent, name).weight.detach()  # (dequantized: a bf16 copy's source)
        out_features = sum(tensors[n].shape[0] for n in names)
        setattr(parent, name, linear := QuantLinear(panels.get(names, qtype), qtype, out_features, width, dtype))
        swapped.append((linear, weight))
    panels.save()
    if dense and dtype == torch.bfloat16:
        keep_dense_copies(swapped)
    return len(swapped)


class PanelCache:
    """The stored-block layers' panels (quant_linear.pack_blocks), packed once per model file and
    kept in the cache folder: repacking every weight took a good part of each process's start.
    The cache's name carries a hash of the code that lays the panels out, so a change to it
    packs afresh (and the stale file is removed)."""

    def __init__(self, path: Path, tensors: dict[str, StoredTensor], config: LlamaConfig) -> None:
        self.path, self.tensors, self.config = path, tensors, config
        self.file = _cached_file(path, f".panels-{_panel_code_key()}.safetensors")
        self.read: dict[str, torch.Tensor] = {}
        self.packed: dict[str, torch.Tensor] = {}
        if self.file.exists():
            from safetensors.torch import load_file

            try:
                self.read = load_file(str(self.file))
            except Exception:  # a damaged cache: pack afresh and write it again
                log.warning("the packed weights cache %s could not be read: packing afresh", self.file)

    def get(self, names: tuple[str, ...], qtype: str) -> torch.Tensor:
        key = "+".join(names)
        if (cached := self.read.get(key)) is not None:
            out = torch.empty(cached.shape, dtype=torch.uint8)  # 64-byte aligned, off the file's pages
            out.copy_(cached)
            return out
        self.packed[key] = pack_blocks(self._blocks(names), qtype)
        return self.packed[key]

    def _blocks(self, names: tuple[str, ...]) -> np.ndarray:
        rows = []
        for name in names:
            raw = np.asarray(self.tensors[name].array(self.path))  # [out_features, bytes of a row of blocks]
            if name.endswith("attn_q.weight"):  # block rows are output features: unpermute them as read_gguf does
                raw = _unpermute(raw, self.config.num_heads)
            elif name.endswith("attn_k.weight"):
                raw = _unpermute(raw, self.config.num_kv_heads)
            rows.append(raw)
        return np.concatenate(rows)

    def save(self) -> None:
        """Writes the cache when anything was packed here (read and packed ones together)."""
        if not self.packed:
            return
        from safetensors.torch import save_file

        tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
        try:
            save_file({**self.read, **self.packed}, str(tmp))
            tmp.replace(self.file)
        except OSError as exc:  # a full or read-only cache folder: the next start packs again
            log.warning("could not keep the packed weights in %s: %s", self.file, exc)
            tmp.unlink(missing_ok=True)
            return
        stem = self.file.name.split(".panels-")[0]
        for stale in self.file.parent.glob(f"{stem}.panels-*.safetensors"):
            if stale != self.file:
                stale.unlink(missing_ok=True)


def _panel_code_key() -> str:
    """A hash of the code that decides the panels' bytes: pack_blocks' module and this one."""
    from fairway.models import quant_linear

    code = Path(quant_linear.__file__).read_bytes() + Path(__file__).read_bytes()
    return hashlib.sha256(code).hexdigest()[:12]


def keep_dense_copies(swapped: list[tuple[QuantLinear, torch.Tensor]]) -> int:
    """Give each of these stored-block layers a bf16 copy of its weight (the dequantized one given
    beside it) for steps of many rows (quant_linear.dense_from_rows); none where this CPU gains
    nothing by it, or where the copies would take more than DENSE_MEMORY_SHARE of the
    free memory. Returns how many."""
    chosen = [(linear, weight, rows) for linear, weight in swapped if (rows := dense_from_rows(linear)) is not None]
    copy_bytes = sum(w.numel() * 2 for _, w, _ in chosen)
    if copy_bytes > DENSE_MEMORY_SHARE * _free_memory():
        log.info("no bf16 copy of the quantized layers for many-row steps: %.0f MB is too much of the free "
                 "memory", copy_bytes / 1e6)
        return 0
    for linear, weight, rows in chosen:
        linear.keep_dense(PackedLinear(weight.to(torch.bfloat16)), rows)
    if chosen:
        log.info("%d of %d stored-block layers: a bf16 copy for steps of %d rows or more", len(chosen), len(swapped),
                 DENSE_FROM_ROWS)
    return len(chosen)


def _free_memory() -> int:
    """Bytes this machine has free for the taking (MemAvailable); unbounded where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 1 << 62


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_hf_folder(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    files = sorted(path.glob("*.safetensors"))
    if not cfg_file.is_file() or not files:
        raise ModelFileError(f"model folder {path} needs config.json and *.safetensors files")
    config = LlamaConfig.from_hf(json.loads(cfg_file.read_text()))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return config, state
