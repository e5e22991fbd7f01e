"""vLLM's offline `LLM.generate` as a benchmark peer, speaking the JSON-lines protocol of
`benchmarks/harness/peer_process.py`. It runs under the peer's own Python and imports only the standard
library and vLLM; the project never imports it.

    <vllm venv>/bin/python benchmarks/peers/vllm_offline_runner.py REQUEST.json

REQUEST.json: {"model": HF folder, "dtype": name, "max_model_len": n, "seed": n,
"warm_up": WORKLOAD, "workloads": {name: WORKLOAD}}, WORKLOAD = {"prompt_token_ids": [[...]],
"max_tokens": [...]}. Every run is greedy with ignore_eos, on an empty prefix cache, and timed
around `LLM.generate` alone (which detokenizes, as the engine's does).
"""

import json
import os
import sys
import time
import traceback


def main() -> int:
    # Run as a script, this folder (benchmarks/peers/, with a vllm.py of ours) heads sys.path;
    # nothing of the project may shadow vLLM from there.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    # The protocol owns the real stdout; everything else written to fd 1 (vLLM's logging, its
    # child processes) goes to stderr, the parent's log file.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        with open(sys.argv[1]) as file:
            request = json.load(file)
        start = time.perf_counter()
        import vllm
        from vllm import LLM

        llm = LLM(
            model=request["model"],
            dtype=request["dtype"],
            max_model_len=request["max_model_len"],
            seed=request["seed"],
        )
        generate(llm, request["warm_up"])
        send({"type": "ready", "version": vllm.__version__,
              "startup_s": time.perf_counter() - start})  # fmt: skip
        for line in sys.stdin:
            if not line.strip():
                continue
            name = json.loads(line)["run"]
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")
            elapsed_s, token_ids = generate(llm, request["workloads"][name])
            send({"type": "result", "workload": name, "elapsed_s": elapsed_s,
                  "output_token_ids": token_ids})  # fmt: skip
    except Exception as exc:
        traceback.print_exc()
        send({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


def generate(llm, workload: dict) -> tuple[float, list[list[int]]]:
    """(seconds, output token ids per prompt, in prompt order) for one `LLM.generate` call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompt_token_ids"]]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for max_tokens in workload["max_tokens"]
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    return elapsed_s, [list(output.outputs[0].token_ids) for output in outputs]


if __name__ == "__main__":
    sys.exit(main())
