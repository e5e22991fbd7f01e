"""scripts/generate.py, the in-process command line, run as users run it: as a program."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from core_engine.frontend.text.tokenizer import load_tokenizer
from tests.helpers.model_fixtures import build_tiny_model_folder
from tests.worker.test_generation_parity import hf_greedy

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cli_prints_one_json_line_per_prompt_in_order(tmp_path):
    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    prompts = ["hello there, how are you?", "a", "The quick brown fox"]
    argv = ["--model", str(folder), "--device", "cpu", "--max-tokens", "6", "--ignore-eos"]
    argv += ["--num-gpu-blocks-override", "64", "--max-num-batched-tokens", "8", *prompts]
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    assert all(line["finish_reason"] == "length" for line in lines)

    tokenizer = load_tokenizer(folder)
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for prompt, line in zip(prompts, lines, strict=True):
        assert line["token_ids"] == hf_greedy(hf_model, tokenizer.encode(prompt), 6)
        assert line["text"] == tokenizer.decode(line["token_ids"])


def test_a_bad_speculative_config_is_refused_naming_the_field():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "hello",
         "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}'],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "num_speculative_tokens is required for method 'ngram'" in result.stderr
