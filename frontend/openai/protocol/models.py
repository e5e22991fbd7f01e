"""GET /v1/models, /v1/models/{id} and /version."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import (
    BaseModel,
    Field,
)


class VersionResponse(BaseModel):
    version: str


class ModelCard(BaseModel):
    """vLLM's card: a LoRA adapter's `parent` is its base model's served name and its `root`
    the adapter's path."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "core-engine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
