"""The Ray backends' options and placement arithmetic, without a Ray cluster; and the mp path,
which never loads Ray (tests/e2e/test_ray_backend.py runs the Ray path on a cluster)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core_engine.common.ray_placement import missing_resources, worker_bundles
from core_engine.proto.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"distributed_executor_backend": "slurm"},
            "distributed_executor_backend must be one of ('mp', 'ray'), got 'slurm'",
        ),
        ({"data_parallel_backend": "k8s"}, "data_parallel_backend must be one of ('mp', 'ray')"),
        (
            {"distributed_executor_backend": "ray", "ray_placement_strategy": "pack"},
            "ray_placement_strategy must be one of ('PACK', 'SPREAD', 'STRICT_PACK', "
            "'STRICT_SPREAD'), got 'pack'",
        ),
        ({"ray_cpus_per_worker": 0}, "ray_cpus_per_worker must be at least 1, got 0"),
        (
            {"data_parallel_backend": "ray"},
            "data_parallel_backend='ray' places each replica's workers with Ray too: set "
            "distributed_executor_backend='ray', got 'mp'",
        ),
        (
            {
                "distributed_executor_backend": "ray",
                "tensor_parallel_size": 2,
                "num_local_workers": 1,
                "worker_address": "tcp://10.0.0.1:5000",
            },
            "num_local_workers=1 is set, but with distributed_executor_backend='ray' Ray places "
            "every rank",
        ),
        (
            {"distributed_executor_backend": "ray", "dist_init_address": "tcp://10.0.0.1:29500"},
            "dist_init_address='tcp://10.0.0.1:29500' is set, but with "
            "distributed_executor_backend='ray'",
        ),
    ],
)
def test_ray_options_are_validated_with_the_values(fields, message):
    with pytest.raises(ValueError) as error:
        EngineConfig(**fields)
    assert message in str(error.value)


def test_the_ray_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    argv = "--distributed-executor-backend ray --data-parallel-backend ray "
    argv += "--ray-placement-strategy STRICT_SPREAD --ray-cpus-per-worker 4"
    config = EngineConfig.from_cli_args(parser.parse_args(argv.split()))
    assert config.distributed_executor_backend == "ray"
    assert config.data_parallel_backend == "ray"
    assert config.ray_placement_strategy == "STRICT_SPREAD"
    assert config.ray_cpus_per_worker == 4
    assert EngineConfig.from_b64(config.to_b64()) == config
    default = EngineConfig()
    assert (default.distributed_executor_backend, default.data_parallel_backend) == ("mp", "mp")
    assert default.ray_placement_strategy == "PACK"


def test_the_llm_constructor_passes_the_backend_to_the_config():
    from core_engine.frontend.llm import LLM

    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(model="null", distributed_executor_backend="slurm")


def test_a_bundle_per_worker_holds_its_cpus_or_one_gpu():
    assert worker_bundles(3, False, 2) == [{"CPU": 2.0}] * 3
    assert worker_bundles(2, True, 2) == [{"GPU": 1.0}] * 2


THREE_NODES = [{"CPU": 1.0, "memory": 1e9}] * 3


@pytest.mark.parametrize(
    ("bundles", "strategy", "nodes", "available", "reason"),
    [
        (
            [{"CPU": 1.0}] * 5,
            "PACK",
            THREE_NODES,
            {"CPU": 3.0},
            "5 bundles of 1 CPU (5 CPU in all); the cluster has 3 CPU: missing 2 CPU",
        ),
        (
            [{"GPU": 1.0}] * 2,
            "PACK",
            THREE_NODES,
            {"CPU": 3.0},
            "2 bundles of 1 GPU (2 GPU in all); the cluster has 0 GPU: missing 2 GPU",
        ),
        (
            [{"CPU": 1.0}] * 2,
            "STRICT_PACK",
            THREE_NODES,
            {"CPU": 3.0},
            "STRICT_PACK puts them all on one node, and the largest has 1 CPU",
        ),
        (
            [{"CPU": 1.0}] * 3,
            "STRICT_SPREAD",
            [{"CPU": 2.0}, {"CPU": 1.0}],
            {"CPU": 3.0},
            "STRICT_SPREAD puts each on its own node, and only 2 node(s) hold 1 CPU",
        ),
        (
            [{"CPU": 2.0}] * 1,
            "PACK",
            THREE_NODES,
            {"CPU": 3.0},
            "1 bundles of 2 CPU (2 CPU in all); no node holds one bundle of 2 CPU",
        ),
        (
            [{"CPU": 1.0}] * 3,
            "SPREAD",
            THREE_NODES,
            {"CPU": 1.0},
            "only 1 CPU is free now (other work holds the rest): missing 2 CPU until it ends",
        ),
    ],
)
def test_missing_resources_are_named_with_amounts(bundles, strategy, nodes, available, reason):
    assert reason in missing_resources(bundles, strategy, nodes, available)


def test_the_mp_path_never_imports_ray():
    """A core with mp workers starts, serves its handshake and stops, in a process where
    importing ray fails; the frontend's modules load there too."""
    script = textwrap.dedent(
        """
        import sys

        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray is blocked in this test")

        sys.meta_path.insert(0, NoRay())
        import core_engine.core.engine_core_proc, core_engine.frontend
        import core_engine.frontend.data_parallel_client
        from core_engine.core.engine_core import start_engine_core
        from core_engine.core.executor.executor_factory import make_executor
        from core_engine.proto.engine_config import EngineConfig

        config = EngineConfig(model="null", tensor_parallel_size=2, num_gpu_blocks_override=512)
        executor = make_executor(config)
        try:
            start_engine_core(config, executor)
        finally:
            executor.shutdown()
        assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules)
        print("no ray")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no ray"
