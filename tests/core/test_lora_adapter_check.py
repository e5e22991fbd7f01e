"""The engine core's own adapter check: a client that skips the frontend gets a ParameterError
for a bad adapter (on `model`), never a worker failure; verdicts are remembered by id and path."""

from __future__ import annotations

import pytest

from core_engine.core.lora_adapter_check import LoRAAdapterCheck
from core_engine.proto import LoRARequest, lora_checkpoint_cache
from core_engine.proto.parameter_error import ParameterError
from tests.common.test_lora_checkpoint import SHAPES, write_adapter


def test_a_good_adapter_passes_and_its_verdict_is_remembered(tmp_path, monkeypatch):
    folder = write_adapter(tmp_path / "good")
    check = LoRAAdapterCheck(SHAPES)
    check.check(LoRARequest("good", 1, str(folder)))
    monkeypatch.setattr(
        lora_checkpoint_cache, "check_lora_checkpoint", lambda *args: pytest.fail("checked twice")
    )
    check.check(LoRARequest("good", 1, str(folder)))
    check.check(None)  # the base model needs no check


def test_a_bad_adapter_is_a_parameter_error_naming_it_and_the_problem(tmp_path):
    folder = write_adapter(tmp_path / "wide", r=64)
    with pytest.raises(
        ParameterError, match=r"'wide'.*rank \(r\) 64, above max_lora_rank 16"
    ) as info:
        LoRAAdapterCheck(SHAPES).check(LoRARequest("wide", 2, str(folder)))
    assert info.value.param == "model"
    with pytest.raises(ParameterError, match="'missing'"):
        LoRAAdapterCheck(SHAPES).check(LoRARequest("missing", 3, str(tmp_path / "nowhere")))


def test_without_enable_lora_every_adapter_is_refused(tmp_path):
    folder = write_adapter(tmp_path / "good")
    with pytest.raises(ParameterError, match="--enable-lora"):
        LoRAAdapterCheck(None).check(LoRARequest("good", 1, str(folder)))
