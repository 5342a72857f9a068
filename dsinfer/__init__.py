"""dsinfer: an LLM inference engine for DeepSeek-family MoE models and dense Llama/Qwen models."""

import os as _os
import sys as _sys

from dsinfer import envs as _envs

# libgomp reads its spin count once, when torch loads it: set before that (envs.CPU_SPIN_COUNT says why)
if ("torch" not in _sys.modules and _envs.CPU_SPIN_COUNT.get() and "GOMP_SPINCOUNT" not in _os.environ
        and "OMP_WAIT_POLICY" not in _os.environ):
    _os.environ["GOMP_SPINCOUNT"] = str(_envs.CPU_SPIN_COUNT.get())

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
