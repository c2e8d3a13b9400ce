"""The GPU runner's bookkeeping on the CPU: decode steps through the capture seam (EagerCapture,
so every "replay" runs the recorded function again), padded to the captured sizes, reading only
the static buffers; attention through the PyTorch twin of the Triton kernels (block_tables.py;
the kernels themselves: test_triton_attention.py); sampling on the device's code path."""

from __future__ import annotations

import torch

from fairway.engine.cuda_graphs import DecodeGraphs, EagerCapture, capture_sizes
from fairway.engine.device_sampler import DeviceSampler
from fairway.engine.gpu_model_runner import GPUModelRunner
from fairway.engine.host_buffers import HostBuffers
from fairway.engine.llm_engine import EngineConfig, LLMEngine
from fairway.engine.sampler import _sample_filtered
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.sequence import Sequence
from fairway.models.block_tables import TorchBlockAttention
from fairway.models.config import LlamaConfig
from fairway.models.llama import random_model


class RecordingCapture(EagerCapture):
    """Eager, and notes what was captured and replayed: (size, static inputs as the step saw them)."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed: list[tuple[int, list[int], list[int]]] = []  # (size, slots, context lengths)
        self.graphs: DecodeGraphs | None = None

    def capture(self, fn):
        size = len(self.captured)
        self.captured.append(size)

        def replay():
            out = fn()
            s = self.graphs.static
            n = out.shape[0]
            assert out.data_ptr() == s.logits.data_ptr()  # every size writes the one static output
            self.replayed.append((n, s.slot_mapping[:n].tolist(), s.context_lens[:n].tolist()))
            return out

        return replay


def engine(model, config: EngineConfig, capture=None) -> LLMEngine:
    runner = None
    if capture is not None:
        runner = GPUModelRunner(model, config.num_kv_blocks, config.block_size, config.max_num_seqs,
                                model.cfg.max_position_embeddings, capture=capture, attention=TorchBlockAttention)
    return LLMEngine(model, config, runner=runner)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(17, 256, (int(length),), generator=gen).tolist()
            for length in torch.randint(3, 40, (n,), generator=gen)]


def same_tokens_as_the_cpu(model, config: EngineConfig, batch: list[list[int]],
                           params: SamplingParams) -> tuple[RecordingCapture, LLMEngine]:
    """The batch through the GPU runner (eager capture) gives the CPU runner's tokens; what it
    recorded and replayed, and its engine."""
    want = engine(model, config).generate(batch, params)
    capture = RecordingCapture()
    gpu = engine(model, config, capture)
    capture.graphs = gpu.runner.graphs
    assert gpu.generate(batch, params) == want
    return capture, gpu


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]


def test_same_tokens_as_the_cpu_runner():
    """Greedy: chunked prefills (a 24-token budget), prefix reuse, decode steps padded to the
    captured sizes, and speculative verification (prompt lookup, on by default) all give the CPU
    runner's tokens."""
    model = random_model(LlamaConfig.tiny(), seed=1)
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=6, max_num_batched_tokens=24)
    batch = prompts(5)
    batch.append(batch[0][:30] + [20, 21, 22])  # shares a prefix with the first
    batch.append([30, 31, 32, 33] * 6)  # repeats itself: prompt lookup proposes drafts
    capture, gpu = same_tokens_as_the_cpu(model, config, batch, SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True))
    assert sorted(capture.captured) == list(range(len(capture_sizes(6))))  # every size recorded once
    assert capture.replayed, "no decode step went through a captured size"
    assert gpu.stats().spec_decode_num_drafts > 0  # draft rows went through the decode path too
    for size, slots, lens in capture.replayed:
        assert size in capture_sizes(6)
        padding = [i for i, n in enumerate(lens) if n == 0]
        assert all(slots[i] == -1 for i in padding)  # padding rows store nothing
        assert all(s >= 0 for i, s in enumerate(slots) if i not in padding)


def test_padding_rows_leave_the_cache_alone():
    """A decode step of 3 rows replays the size-4 recording: its 4th row stores nothing."""
    model = random_model(LlamaConfig.tiny(), seed=2)
    config = EngineConfig(num_kv_blocks=32, max_num_seqs=4, speculative=None)
    capture = RecordingCapture()
    gpu = engine(model, config, capture)
    capture.graphs = gpu.runner.graphs
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=3)):
        gpu.add_request(str(i), p, params)
    gpu.step()  # the three prompts
    k_before = gpu.runner.kv.k.clone()
    gpu.step()  # three decode rows: padded to 4
    size, slots, lens = capture.replayed[-1]
    assert (size, slots[3], lens[3]) == (4, -1, 0)
    written = (gpu.runner.kv.k != k_before).any(dim=(0, 1, 3)).nonzero().flatten().tolist()
    assert sorted(written) == sorted(slots[:3])


def test_a_step_larger_than_every_size_runs_eagerly():
    model = random_model(LlamaConfig.tiny(), seed=4)
    runner = GPUModelRunner(model, 16, 16, max_num_seqs=2, max_model_len=256, capture=EagerCapture(),
                            attention=TorchBlockAttention)
    assert not runner.kv.k.any() and not runner.kv.v.any()  # recording and warming up stored nothing
    assert runner.graphs.bucket(2) == 2 and runner.graphs.bucket(3) is None
    assert runner.graphs.takes(2, 16) and not runner.graphs.takes(3, 1)
    assert not runner.graphs.takes(1, 17)  # a table wider than the static one (256 tokens / 16) runs eagerly


def test_device_sampler_draws_as_the_host_sampler():
    """Same uniforms from the same generators against the same inverse CDF: the host sampler's
    tokens for top-k/top-p rows, argmax for greedy ones, and the generators left alike."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 300, generator=gen) * 3
    settings = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, seed=1),
                SamplingParams(temperature=1.2, top_p=0.9, seed=2), SamplingParams(temperature=0.5, seed=3),
                SamplingParams(temperature=1.0, top_k=5, top_p=0.5, seed=4)]

    def seqs() -> list[Sequence]:
        return [Sequence(str(i), [1], p) for i, p in enumerate(settings)]

    device_seqs, host_seqs = seqs(), seqs()
    got = DeviceSampler(HostBuffers(torch.device("cpu"))).sample(logits.clone(), device_seqs).tolist()
    assert got[0] == logits[0].argmax().item()
    want = _sample_filtered(logits[1:].clone(), host_seqs[1:]).tolist()
    assert got[1:] == want
    for a, b in zip(device_seqs[1:], host_seqs[1:], strict=True):
        assert torch.equal(a.generator.get_state(), b.generator.get_state())


def test_a_one_token_chunk_mid_prompt_is_a_decode_row_not_sampled():
    """Four replies decoding under a 5-token budget leave the long prompt one token a step: a
    decode row of a decode-only step (captured) whose logits are not sampled."""
    model = random_model(LlamaConfig.tiny(), seed=6)
    config = EngineConfig(num_kv_blocks=32, max_num_seqs=5, max_num_batched_tokens=5, speculative=None,
                          bound_step_time=False)
    batch = [[20 + i, 30, 40] for i in range(4)] + [list(range(50, 90))]
    capture, _ = same_tokens_as_the_cpu(model, config, batch, SamplingParams(temperature=0, max_tokens=24,
                                                                             ignore_eos=True))
