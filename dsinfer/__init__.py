"""dsinfer: an LLM inference engine for DeepSeek-family MoE models and dense Llama/Qwen models."""

from dsinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from dsinfer.structured.spec import StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch models and the runner: import it on first use only.
    if name == "LLM":
        from dsinfer.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":
        from dsinfer.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'dsinfer' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "EngineArgs", "Logprob", "RequestOutput", "RequestOutputKind",
           "SamplingParams", "StructuredOutputsParams", "__version__"]
