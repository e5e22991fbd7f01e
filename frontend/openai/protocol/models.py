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
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "core-engine"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
