"""`llm-cluster serve` flags down to the engine configs and the router deployment (no Ray needed)."""

from __future__ import annotations

from cluster.app import router_deployment
from cluster.cli import build_parser, cluster_config_from_args


def _config(*flags: str):
    return cluster_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_scheduler_and_engine_flags_reach_every_engine():
    config = _config("--num-engines", "2", "--max-num-seqs", "8", "--long-prefill-token-threshold", "64",
                     "--engine-niceness", "2", "--no-enable-prefix-caching", "--scheduling-policy", "priority")
    engines = config.engine_configs()
    assert len(engines) == 2
    for engine in engines:
        assert engine.scheduler.max_num_seqs == 8 and engine.scheduler.long_prefill_token_threshold == 64
        assert engine.engine_niceness == 2 and not engine.enable_prefix_caching
        assert engine.scheduler.policy == "priority"


def test_the_access_log_is_on_unless_disabled():
    assert router_deployment(_config())._bound_deployment.logging_config["enable_access_log"] is True
    quiet = _config("--disable-access-log", "--num-router-replicas", "2")
    deployment = router_deployment(quiet)._bound_deployment  # the deployment behind the bound application
    assert deployment.logging_config["enable_access_log"] is False and deployment.num_replicas == 2
