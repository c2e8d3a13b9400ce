"""One replica's engine: sequences, block pool, scheduler, model runner, sampler."""

from fairway.domain import Priority
from fairway.engine.async_engine import AsyncEngine, EngineDead
from fairway.engine.llm_engine import EngineConfig, LLMEngine, RequestRejected
from fairway.engine.outputs import FinishReason, RequestOutput
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.stats import EngineStats

__all__ = ["AsyncEngine", "EngineConfig", "EngineDead", "EngineStats", "FinishReason", "LLMEngine",
           "Priority", "RequestOutput", "RequestRejected", "SamplingParams"]
