"""cluster/runtime.py: joining or starting Ray, and checking that the workers fit before placing them."""

import socket
import subprocess
import sys
import time

import pytest

from sleuth.cluster.runtime import ClusterError, Node, WorkerSpec, place, worker_specs
from sleuth.config import ClusterConfig, load_config
from sleuth.errors import ConfigError


def node(name: str, cpus: float, gpus: float = 0) -> Node:
    return Node(node_id=name, ip=name, cpus=cpus, gpus=gpus, memory_gb=64)


def test_one_process_default_needs_no_ray():
    assert not ClusterConfig().uses_ray
    assert ClusterConfig(rollout_workers=2).uses_ray
    assert ClusterConfig(trainer_workers=2).uses_ray
    assert ClusterConfig(address="auto").uses_ray


def test_address_must_be_auto_or_host_port():
    assert load_config(None, ["cluster.address=10.1.2.3:6379"]).cluster.address == "10.1.2.3:6379"
    for bad in ("somewhere", "host:", "host:70000", ":6379"):
        with pytest.raises(ConfigError, match=r"cluster\.address"):
            load_config(None, [f"cluster.address={bad}"])


def test_worker_specs_default_to_one_gpu_each_only_where_there_are_gpus():
    cfg = ClusterConfig(trainer_workers=4, rollout_workers=2)
    on_gpus = worker_specs(cfg, [node("a", 64, 8)])
    assert [(s.kind, s.gpus) for s in on_gpus] == [("trainer", 1.0)] * 4 + [("rollout", 1.0)] * 2
    assert {s.gpus for s in worker_specs(cfg, [node("a", 64)])} == {0.0}
    # one trainer rank stays in the driver: no actor for it
    assert [s.kind for s in worker_specs(ClusterConfig(rollout_workers=3), [node("a", 4)])] == ["rollout"] * 3


def test_place_fills_nodes_gpu_workers_first():
    specs = [WorkerSpec("trainer", i, 1, 1) for i in range(4)] + [WorkerSpec("rollout", i, 1, 2) for i in range(2)]
    plan = place(specs, [node("a", 16, 4), node("b", 16, 4)])
    assert [a.spec for a in plan] == specs  # returned in the order asked
    by = {(a.spec.kind, a.spec.index): (a.node.node_id, a.gpu_slots) for a in plan}
    # the 2-GPU rollout workers are placed first, then the 1-GPU trainer ranks fill the rest
    assert by[("rollout", 0)] == ("a", (0, 1)) and by[("rollout", 1)] == ("a", (2, 3))
    assert [by[("trainer", i)] for i in range(4)] == [("b", (0,)), ("b", (1,)), ("b", (2,)), ("b", (3,))]


def test_place_names_what_is_missing():
    with pytest.raises(ClusterError, match=r"need 4 GPUs but the cluster has 0"):
        place([WorkerSpec("rollout", i, 1, 2) for i in range(2)], [node("a", 8)])
    with pytest.raises(ClusterError, match=r"need 6 CPUs \(cluster.cpus_per_worker=3 x 2 workers\) but the "
                                           r"cluster has 4"):
        place([WorkerSpec("rollout", i, 3, 0) for i in range(2)], [node("a", 2), node("b", 2)])
    # enough in total, but no single node holds a 4-GPU worker
    with pytest.raises(ClusterError, match="rollout worker 0 needs 1 CPUs and 4 GPUs on one node"):
        place([WorkerSpec("rollout", 0, 1, 4)], [node("a", 8, 2), node("b", 8, 2)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sleuth(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sleuth", "train", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_weight_transport_is_one_of_its_names():
    assert load_config(None, []).cluster.weight_transport == "auto"
    assert load_config(None, ["cluster.weight_transport=collective"]).cluster.weight_transport == "collective"
    with pytest.raises(ConfigError, match=r"cluster\.weight_transport.*unknown value 'nccl'; choose from auto, "
                                          r"collective, object_store"):
        load_config(None, ["cluster.weight_transport=nccl"])


def test_unreachable_address_is_one_line_and_exit_2(tmp_path):
    port = _free_port()  # nothing listens there
    t = time.monotonic()
    proc = _sleuth(f"cluster.address=127.0.0.1:{port}", "cluster.connect_timeout_s=5", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("sleuth: error")]
    assert lines == [f"sleuth: error: cannot reach the Ray cluster at cluster.address=127.0.0.1:{port} within "
                     "5 s (cluster.connect_timeout_s): Connection refused"]
    assert time.monotonic() - t < 60  # (the Python start-up, not a retry loop)


@pytest.mark.slow
def test_more_gpus_than_the_local_cluster_has_is_a_clear_error(tmp_path):
    # sleuth starts a local Ray cluster (no GPUs here), sees the workers cannot fit, stops it, exits 2.
    proc = _sleuth("cluster.rollout_workers=2", "cluster.gpus_per_rollout_worker=1", "cluster.object_store_gb=0.1",
                   "--out", str(tmp_path / "r"))
    assert "the workers need 2 GPUs but the cluster has 0" in _one_error(proc)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    """The one `sleuth: error` line of a command that exited 2."""
    assert proc.returncode == 2, proc.stderr
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("sleuth: error")]
    assert len(error) == 1, proc.stderr
    return error[0]


def test_quantized_base_with_fsdp2_ranks_is_refused_before_ray_starts(tmp_path):
    proc = _sleuth("cluster.trainer_workers=2", "model.quantization=nf4", "--out", str(tmp_path / "r"))
    assert "model.quantization=nf4 with cluster.trainer_workers > 1" in _one_error(proc)
    assert "Ray" not in proc.stderr


def test_tensor_parallel_rollout_workers_need_vllm(tmp_path):
    proc = _sleuth("cluster.rollout_workers=2", "cluster.gpus_per_rollout_worker=2", "rollout.engine=hf",
                   "--out", str(tmp_path / "r"))
    assert "use rollout.engine=vllm" in _one_error(proc)


def test_transformers_engine_refuses_a_tensor_parallel_size(tiny_model_dir):
    from sleuth.config import RolloutConfig
    from sleuth.rollout.factory import make_engine

    with pytest.raises(ConfigError, match="transformers engine runs on one GPU"):
        make_engine(RolloutConfig(engine="hf"), str(tiny_model_dir), "float32", 0, tensor_parallel_size=2)
