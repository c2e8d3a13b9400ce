"""Weight loading: the cached GGUF path, Hugging Face folders, and clear errors for bad files."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from probes import PARIS_PROMPT

from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.models.bundled import ModelFileError
from fairway.models.loader import load_model, read_config, stored_tensors
from fairway.models.precision import compute_dtype
from fairway.models.quant_linear import QuantLinear, native_types


def test_a_second_gguf_load_reads_the_cache_without_dequantizing(model_path, monkeypatch):
    """The first load dequantizes the GGUF and caches it; later ones only read that cache (which
    is what makes them take a fraction of the time: bench/README.md, not a timed test here)."""
    import gguf

    load_model(model_path)  # dequantizes and caches on first use
    read_config(model_path)  # (the command line's check of --max-model-len: the metadata alone)

    def no_dequantizing(*_args, **_kwargs):
        raise AssertionError("a cached load dequantized the GGUF again")

    def no_parsing(*_args, **_kwargs):
        raise AssertionError("a cached load parsed the GGUF's metadata again")

    monkeypatch.setattr(gguf.quants, "dequantize", no_dequantizing)
    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)  # its native layers' blocks too, by the cached layout
    model = load_model(model_path, torch.bfloat16)
    assert read_config(model_path) == model.cfg
    held = compute_dtype(torch.bfloat16, "cpu")  # float32 on a CPU without bf16 matmuls
    assert next(model.parameters()).dtype == held
    assert any(isinstance(m, QuantLinear) for m in model.modules()) or not native_types(held)


def test_stored_block_layers_are_packed_once_and_a_damaged_cache_is_packed_again(model_path, monkeypatch, caplog):
    """Each stored-block layer's panels are packed on the first load and read back from the cache
    folder by later ones, byte for byte what packing gives; a cache that cannot be read is packed
    afresh and written again, and a cache of other packing code is removed."""
    from fairway.models import loader
    from fairway.models.quant_linear import pack_blocks

    if not native_types(torch.float32):
        pytest.skip("no native kernel for stored blocks on this CPU")
    names = {"qkv": ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
             "head": ("token_embd.weight",)}

    def panels(model) -> dict[str, torch.Tensor]:
        return {"qkv": model.layers[0].self_attn.qkv_proj.panels, "head": model.lm_head.panels}

    def packing_afresh(model) -> None:
        cache = loader.PanelCache(model_path, loader.stored_tensors(model_path), model.cfg)
        for key, got in panels(model).items():
            qtype = model.layers[0].self_attn.qkv_proj.qtype if key == "qkv" else model.lm_head.qtype
            assert torch.equal(got, pack_blocks(cache._blocks(names[key]), qtype)), key

    load_model(model_path, torch.float32, pack=False)  # packs, or reads an earlier load's cache

    def no_packing(*_args):
        raise AssertionError("a cached load packed a layer again")

    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_blocks", no_packing)
        model = load_model(model_path, torch.float32, pack=False)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * model.cfg.num_layers + 1
    packing_afresh(model)

    monkeypatch.setattr(loader, "_panel_code_key", lambda: "test-damaged")
    damaged = loader.PanelCache(model_path, {}, model.cfg).file
    stale = damaged.with_name(damaged.name.replace("test-damaged", "test-stale"))
    try:
        damaged.write_bytes(b"not a safetensors file")
        stale.write_bytes(b"the panels of other packing code")
        model = load_model(model_path, torch.float32, pack=False)
        assert "could not be read" in caplog.text
        packing_afresh(model)
        assert not stale.exists()
        monkeypatch.setattr(loader, "pack_blocks", no_packing)
        load_model(model_path, torch.float32, pack=False)  # written again whole
    finally:
        damaged.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)


def test_the_cached_layout_of_a_gguf_finds_each_tensor_where_the_gguf_reader_does(model_path):
    import gguf
    import numpy as np

    stored_tensors(model_path)  # cached on first use
    layout = stored_tensors(model_path)
    tensors = gguf.GGUFReader(str(model_path)).tensors
    assert set(layout) == {t.name for t in tensors}
    for t in tensors:
        kept = layout[t.name]
        assert kept.type_name == t.tensor_type.name
        assert np.array_equal(kept.array(model_path), np.asarray(t.data)), t.name


def test_hf_safetensors_folder_gives_the_same_tokens(tmp_path, hf_model, real_model_fp32, real_tokenizer):
    # A Hugging Face folder as save_pretrained writes it (transformers won't re-save a GGUF-loaded model).
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(hf_model.config.to_json_string())
    folder_model = load_model(tmp_path, torch.float32)
    prompt = real_tokenizer.chat_prompt_ids([{"role": "user", "content": "Name three rivers."}])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    a = LLMEngine(folder_model, EngineConfig(num_kv_blocks=64)).generate([prompt], params)
    b = LLMEngine(real_model_fp32, EngineConfig(num_kv_blocks=64)).generate([prompt], params)
    assert a == b


def test_bfloat16_model_generates_sensible_text(model_path, real_tokenizer):
    model = load_model(model_path, torch.bfloat16)
    eng = LLMEngine(model, EngineConfig(num_kv_blocks=64), tokenizer=real_tokenizer)
    prompt = real_tokenizer.chat_prompt_ids([{"role": "user", "content": PARIS_PROMPT}])
    eng.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=20))
    text = ""
    while eng.has_unfinished():
        text += "".join(o.text for o in eng.step())
    assert "Paris" in text


def test_missing_and_corrupt_model_files_say_which_file(tmp_path):
    with pytest.raises(ModelFileError, match="nope.gguf"):
        load_model(tmp_path / "nope.gguf")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelFileError, match="broken.gguf"):
        load_model(bad)
    with pytest.raises(ModelFileError, match="config.json"):
        load_model(tmp_path)


def test_cli_generate_prints_only_the_generated_text():
    run = subprocess.run([sys.executable, "-m", "fairway.cli", "generate", "--prompt",
                          PARIS_PROMPT, "--chat", "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout and "<|im" not in run.stdout
    bad = subprocess.run([sys.executable, "-m", "fairway.cli", "generate", "--prompt", "x",
                          "--model", "/no/such/model.gguf"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines()[-1].endswith("argument --model: '/no/such/model.gguf' does not exist: pass a .gguf "
                                                "file or a Hugging Face folder")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_packed_linear_matches_plain_linear(dtype, tol):
    from fairway.models.packed_linear import PackedLinear, packing_supported

    if not packing_supported(dtype, torch.device("cpu")):
        pytest.skip(f"this CPU has no oneDNN {dtype} support")
    weight = torch.randn(300, 576).to(dtype)
    packed = PackedLinear(weight)
    for rows in (1, 3, 64, 700):
        x = torch.randn(rows, 576).to(dtype)
        torch.testing.assert_close(packed(x).float(), torch.nn.functional.linear(x, weight).float(),
                                   atol=tol, rtol=tol / 5)


def test_bf16_weights_compute_in_the_dtype_this_cpu_multiplies_fast(model_path):
    from fairway.models.precision import compute_dtype, cpu_half_matmul_supported

    model = load_model(model_path, torch.bfloat16, pack=False, weights="dequantized")
    weight = model.layers[0].mlp.down_proj.weight
    if cpu_half_matmul_supported(torch.bfloat16):
        assert weight.dtype == torch.bfloat16
    else:  # held in float32, but every value is the bf16-rounded weight
        assert compute_dtype(torch.bfloat16, "cpu") == weight.dtype == torch.float32
        assert torch.equal(weight, weight.to(torch.bfloat16).float())
    assert compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16
