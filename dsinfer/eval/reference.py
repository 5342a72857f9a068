"""The transformers model a check compares against, loaded from the same checkpoint as the engine's (an HF
directory, a ``.gguf`` file through transformers' ``gguf_file=``, or the bundled GGUF), in float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_reference(model: str | None):
    """``AutoModelForCausalLM`` in float32 on CPU, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    path = _model_path(model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf.eval()


def _model_path(model: str | None) -> Path:
    if model is None:
        from dsinfer.models.loader.gguf import default_model_path

        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--model {model}: no such file or directory (a local checkpoint is needed for "
                                "the transformers reference)")
    return path


def reference_token_logprobs(hf, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' logprob of each token 1..n-1 given the tokens before it, and its top-1 id at each position."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(ids[1:])
    return (logprobs.gather(1, targets[:, None])[:, 0].double().numpy(),
            logprobs.argmax(dim=-1).numpy())
