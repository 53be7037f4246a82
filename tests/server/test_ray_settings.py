"""The worker-backend settings and ``cipherlm serve --cluster`` (no Ray cluster needed)."""

from __future__ import annotations

import argparse

import pydantic
import pytest

from server.cli_serve import load_settings, register, with_cluster
from server.private.backend import make_pool
from server.private.config import PrivateSettings
from server.private.workers import WorkerPool
from server.settings import Settings


def test_local_is_the_default_backend_and_builds_the_process_pool():
    cfg = PrivateSettings()
    assert cfg.backend == "local" and cfg.ray.address is None
    assert isinstance(make_pool(cfg, "m:f", ()), WorkerPool)
    assert make_pool(cfg, "m:f", ()).start_timeout == 120.0
    # a worker of the 28-layer offload plan builds for minutes: the setting reaches the pool
    assert make_pool(PrivateSettings(worker_start_timeout_s=900), "m:f", ()).start_timeout == 900


def test_bad_backend_values_are_validation_errors():
    for bad in ({"backend": "k8s"}, {"ray": {"num_cpus": -1}}, {"ray": {"memory_gb": 0}}):
        with pytest.raises(pydantic.ValidationError):
            PrivateSettings(**bad)


def test_ray_backend_builds_actors_pool_with_the_resource_shape():
    pytest.importorskip("ray")
    from server.private.ray_backend import RayWorkerPool

    cfg = PrivateSettings(backend="ray", workers=3, ray={"num_cpus": 2, "num_gpus": 0.25, "memory_gb": 6})
    pool = make_pool(cfg, "m:f", ())
    assert isinstance(pool, RayWorkerPool) and pool.size == 3
    assert pool._options() == {"num_cpus": 2, "num_gpus": 0.25, "memory": 6 << 30}


def test_serve_cluster_flag_selects_ray(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[private]\nworkers = 4\n")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for flag, address in (("local", None), ("10.1.2.3:6379", "10.1.2.3:6379")):
        args = parser.parse_args(["serve", "--config", str(path), "--cluster", flag])
        s = load_settings(args)
        assert (s.private.backend, s.private.ray.address, s.private.workers) == ("ray", address, 4)
    args = parser.parse_args(["serve", "--config", str(path)])
    assert load_settings(args).private.backend == "local"
    assert with_cluster(Settings(), "local").private.ray.num_cpus == 1.0


def test_serve_tensor_parallel_flag_sets_the_engine_and_refuses_a_size_the_heads_do_not_fit(tmp_path):
    from engine.config import ModelConfig
    from engine.errors import ParallelConfigError
    from server.cli_serve import with_tensor_parallel

    model = tmp_path / "model"
    model.mkdir()
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=8)
    (model / "config.json").write_text(__import__("json").dumps(cfg.to_hf_dict()))
    path = tmp_path / "s.toml"
    path.write_text(f'model = "{model}"\n[engine]\nmax_num_seqs = 8\n')
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    s = load_settings(parser.parse_args(["serve", "--config", str(path), "--tensor-parallel", "3"]))
    assert s.engine == {"max_num_seqs": 8, "tensor_parallel_size": 3}
    with pytest.raises(ParallelConfigError, match=r"9 query heads, 3 KV heads.*\[1, 3\]"):
        load_settings(parser.parse_args(["serve", "--config", str(path), "--tensor-parallel", "2"]))
    assert with_tensor_parallel(Settings(model=str(tmp_path / "absent")), 4).engine["tensor_parallel_size"] == 4


def test_serve_kv_cache_dtype_flag_sets_the_engine_and_refuses_what_the_engine_refuses(tmp_path):
    from engine.errors import ParallelConfigError
    from server.cli_serve import with_kv_cache_dtype

    path = tmp_path / "s.toml"
    path.write_text('[engine]\nmax_num_seqs = 8\ndevice = "cpu"\n')
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    s = load_settings(parser.parse_args(["serve", "--config", str(path), "--kv-cache-dtype", "fp8_e4m3"]))
    assert s.engine == {"max_num_seqs": 8, "device": "cpu", "kv_cache_dtype": "fp8_e4m3"}
    assert "kv_cache_dtype" not in load_settings(parser.parse_args(["serve", "--config", str(path)])).engine
    with pytest.raises(SystemExit):  # argparse: not a choice
        parser.parse_args(["serve", "--kv-cache-dtype", "int8"])
    with pytest.raises(ParallelConfigError, match="tensor parallelism"):
        with_kv_cache_dtype(Settings(engine={"device": "cpu", "tensor_parallel_size": 2}), "fp8")
    with pytest.raises(ValueError, match=r"\[engine\] settings"):
        with_kv_cache_dtype(Settings(engine={"no_such_knob": 1}), "fp8_e4m3")


def test_serve_refuses_an_unknown_engine_key_before_it_starts(tmp_path):
    """A key the engine does not know (here a switch session 30 removed) stops `cipherlm serve` with a one-line
    error and exit code 2, before the app or the engine is built."""
    from server.cli_serve import serve

    path = tmp_path / "s.toml"
    path.write_text('[engine]\ndevice = "cpu"\ncuda_persistent_decode = true\n')
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--config", str(path)])
    with pytest.raises(ValueError, match="cuda_persistent_decode"):
        load_settings(args)
    assert serve(args) == 2
