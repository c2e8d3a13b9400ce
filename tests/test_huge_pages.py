"""The KV cache and the model's weights on 2 MB pages (fairway/models/huge_pages.py), where Linux
lends them: the memory really is backed by huge pages, and nothing the model computes changes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from fairway.models import huge_pages
from fairway.models.bundled import bundled_model_path
from fairway.models.config import LlamaConfig
from fairway.models.llama import random_model
from fairway.models.loader import load_model
from fairway.models.paged_attention import PagedKVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
lent = sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()
needs_thp = pytest.mark.skipif(not lent, reason="this host lends no transparent huge pages")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds address, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head[1], 16) <= address < int(head[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@needs_thp
def test_the_kv_cache_sits_on_huge_pages():
    kv = PagedKVCache(4, 1024, 16, 2, 64, torch.bfloat16, "cpu")  # 16 MB a tensor
    for t in (kv.k, kv.v):
        assert t.shape == (4, 2, 16384, 64) and not t.any()
        assert huge_bytes_at(t.data_ptr() + t.nbytes // 2) >= 8 << 20


@needs_thp
def test_huge_pages_that_come_slowly_are_given_up_for_the_rest(monkeypatch):
    """Where each huge page takes long to come (the host compacts memory for it: seconds for a KV
    cache at every start), the part of the range not yet touched goes on small pages; the tensor
    is zeroed all the same. (Every page counts as slow here.)"""
    monkeypatch.setattr(huge_pages, "SLOW_PAGE_S", 0.0)
    monkeypatch.setattr(huge_pages, "PROBE_PAGES", 2)
    t = huge_pages.fresh(16 << 20)
    assert huge_pages.advise_huge_pages(t) == 16 << 20
    assert huge_pages.zero_in_place(t) == 4 << 20  # the first probe's two pages, then small ones
    assert not t.any()
    assert huge_bytes_at(t.data_ptr() + (12 << 20)) == 0
    kv = PagedKVCache(4, 1024, 16, 2, 64, torch.bfloat16, "cpu")
    assert not kv.k.any() and not kv.v.any()


@needs_thp
def test_gathered_weights_compute_what_they_did_on_huge_pages():
    cfg = LlamaConfig.tiny()
    model = random_model(cfg, seed=1)
    big = torch.nn.Linear(1024, 2048, bias=False)  # 8 MB: the model then spans whole huge pages
    model.add_module("extra", big)
    model.lm_head.weight = model.embed_tokens.weight  # tied, as the bundled model's are
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.arange(10)
    want = model.embed_tokens(ids) @ big.weight[:, :cfg.hidden_size].T

    assert huge_pages.gather(model) >= 4 << 20
    assert model.lm_head.weight is model.embed_tokens.weight  # still one tensor
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    addresses = sorted(p.data_ptr() for p in model.parameters())
    assert addresses[-1] - addresses[0] < sum(p.nbytes for p in model.parameters()) + 64 * len(addresses)
    assert huge_bytes_at(big.weight.data_ptr() + big.weight.nbytes // 2) > 0
    assert torch.equal(model.embed_tokens(ids) @ big.weight[:, :cfg.hidden_size].T, want)


def test_the_loaded_model_keeps_its_weights_in_one_allocation():
    """The loader gathers before the native decode pass reads the pointers: every weight the pass
    reads is inside the gathered allocation."""
    model = load_model(bundled_model_path(), torch.bfloat16, weights="native")
    if model.native_decode is None:
        pytest.skip("no native decode pass on this build")
    storages = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    if lent:
        assert len(storages) == 1
    first = model.layers[0].self_attn.qkv_proj
    panels = getattr(first, "panels", None)
    assert panels is None or panels.untyped_storage().data_ptr() in storages
