"""A Serve redeploy (``build_app`` again) reconciles the detached engines with the new args, and
``llm-cluster stop`` removes what a Serve deploy left running. Real local Ray, tiny model."""

from __future__ import annotations

import pytest

from cluster.app import reconcile_engines, router_deployment, stop_app
from cluster.config import ClusterConfig, EngineSpec
from cluster.launcher import engine_actor_name, engine_placement_group_name, named_actor, placement_groups_named

pytestmark = pytest.mark.slow

NAMESPACE = "redeploy-test"  # its own: the engine names are fixed per namespace


def _config(model_dir, num_engines: int, max_num_seqs: int, namespace: str = NAMESPACE) -> ClusterConfig:
    return ClusterConfig(model=str(model_dir), num_engines=num_engines, namespace=namespace,
                         defaults=EngineSpec(num_gpu_blocks=32, max_model_len=128, max_num_seqs=max_num_seqs,
                                             num_cpus_per_worker=0.5))


def _placement_group_exists(name: str, namespace: str = NAMESPACE) -> bool:
    return bool(placement_groups_named(engine_placement_group_name(name, namespace)))


def test_a_redeploy_keeps_unchanged_engines_and_replaces_changed_or_extra_ones(ray_cluster, tiny_model_dir):
    import ray

    try:
        assert reconcile_engines(_config(tiny_model_dir, 1, 8)) == [0]
        first = named_actor(engine_actor_name(0), NAMESPACE)
        assert reconcile_engines(_config(tiny_model_dir, 1, 8)) == []  # same args: the same engine serves on
        assert named_actor(engine_actor_name(0), NAMESPACE)._actor_id == first._actor_id
        # New flags: engine 0 is replaced, and it runs them.
        assert reconcile_engines(_config(tiny_model_dir, 1, 4)) == [0]
        engine = named_actor(engine_actor_name(0), NAMESPACE)
        assert engine._actor_id != first._actor_id
        assert ray.get(engine.engine_config.remote()).scheduler.max_num_seqs == 4
        # More engines: only the new one starts; fewer: the extra one stops and frees its bundles.
        assert reconcile_engines(_config(tiny_model_dir, 2, 4)) == [1]
        assert reconcile_engines(_config(tiny_model_dir, 1, 4)) == []
        assert named_actor(engine_actor_name(1), NAMESPACE) is None
        assert not _placement_group_exists(engine_actor_name(1))
        assert _placement_group_exists(engine_actor_name(0))
    finally:
        stopped = stop_app(NAMESPACE, app_name="redeploy-test-app")
    assert stopped == [engine_actor_name(0)]
    assert named_actor(engine_actor_name(0), NAMESPACE) is None
    assert not _placement_group_exists(engine_actor_name(0))


def test_two_applications_in_their_own_namespaces_keep_each_others_engines(ray_cluster, tiny_model_dir):
    """Two Serve-config applications on one cluster (the README: each its own ``namespace``): both
    have an engine 0. Starting, replacing and stopping one's engines leaves the other's actor and
    worker bundles alone (placement group names are cluster-wide; they used to collide)."""
    import ray

    a, b = "redeploy-test-a", "redeploy-test-b"
    try:
        assert reconcile_engines(_config(tiny_model_dir, 1, 8, namespace=a)) == [0]
        engine_a = named_actor(engine_actor_name(0), a)
        assert reconcile_engines(_config(tiny_model_dir, 1, 4, namespace=b)) == [0]
        assert reconcile_engines(_config(tiny_model_dir, 1, 2, namespace=b)) == [0]  # b replaces its own
        assert stop_app(b, app_name="redeploy-test-app-b") == [engine_actor_name(0)]
        assert named_actor(engine_actor_name(0), b) is None
        assert not _placement_group_exists(engine_actor_name(0), b)
        # a's engine is the same actor, still holds its bundles, and still serves its own flags.
        assert named_actor(engine_actor_name(0), a)._actor_id == engine_a._actor_id
        assert _placement_group_exists(engine_actor_name(0), a)
        assert ray.get(engine_a.engine_config.remote(), timeout=60).scheduler.max_num_seqs == 8
        assert ray.get(engine_a.check_health.remote(), timeout=60) is True
    finally:
        stop_app(a, app_name="redeploy-test-app-a")
        stop_app(b, app_name="redeploy-test-app-b")
    assert not _placement_group_exists(engine_actor_name(0), a)


def test_a_redeploy_with_engine_autoscaling_keeps_the_engines_it_started(ray_cluster, tiny_model_dir):
    """A Serve deploy with engine_autoscaling starts min_engines and a detached autoscaler; a redeploy
    keeps an engine the autoscaler started in a further slot while its flags are unchanged, stops it
    when they change, and restarts the autoscaler on the new config; ``llm-cluster stop`` stops it all."""
    import ray

    from cluster.autoscaler import AUTOSCALER_NAME
    from cluster.launcher import start_engine

    namespace = "redeploy-test-autoscaled"

    def validated(max_num_seqs: int) -> ClusterConfig:
        return ClusterConfig(model=str(tiny_model_dir), namespace=namespace,
                             defaults=EngineSpec(num_gpu_blocks=32, max_model_len=128, max_num_seqs=max_num_seqs,
                                                 num_cpus_per_worker=0.5),
                             engine_autoscaling={"min_engines": 1, "max_engines": 2, "downscale_delay_s": 3600})

    try:
        assert reconcile_engines(validated(8)) == [0]
        first_autoscaler = named_actor(AUTOSCALER_NAME, namespace)
        assert first_autoscaler is not None
        # As the autoscaler would under load: an engine in slot 1, with that slot's flags.
        slot = validated(8).engine_slot_configs()[1]
        ray.get(start_engine(slot, namespace, detached=True).actor.describe.remote(), timeout=120)
        scaled = named_actor(engine_actor_name(1), namespace)
        assert reconcile_engines(validated(8)) == []
        assert named_actor(engine_actor_name(1), namespace)._actor_id == scaled._actor_id
        autoscaler = named_actor(AUTOSCALER_NAME, namespace)
        assert autoscaler._actor_id != first_autoscaler._actor_id
        assert ray.get(autoscaler.status.remote(), timeout=30)[0].running in ([], [0, 1])  # (first round may be due)
        # New flags: engine 0 is replaced and the autoscaled engine, which ran the old ones, is stopped.
        assert reconcile_engines(validated(4)) == [0]
        assert named_actor(engine_actor_name(1), namespace) is None
        assert not _placement_group_exists(engine_actor_name(1), namespace)
    finally:
        stopped = stop_app(namespace, app_name="redeploy-test-app-autoscaled")
    assert stopped == [engine_actor_name(0)]
    assert named_actor(AUTOSCALER_NAME, namespace) is None


def test_a_redeploy_changing_one_models_engines_leaves_another_models_engines_alone(ray_cluster, tiny_model_dir):
    """Two models: the first one's engine count goes from 1 to 2 and back. The second model's engine
    stays the same actor at its index throughout (it used to be found at a shifted index, and
    replaced); the first model's new engine takes a free index, and goes again."""
    namespace = "redeploy-test-two-models"

    def config(first_engines: int) -> ClusterConfig:
        defaults = {"num_gpu_blocks": 32, "max_model_len": 128, "num_cpus_per_worker": 0.5}
        return ClusterConfig(model=str(tiny_model_dir), served_model_name="a", num_engines=first_engines,
                             namespace=namespace, defaults=EngineSpec(**defaults), models=[
                                 {"model": str(tiny_model_dir), "served_model_name": "b"}])

    try:
        assert reconcile_engines(config(1)) == [0, 1]
        b = named_actor(engine_actor_name(1), namespace)
        grown = config(2)
        assert reconcile_engines(grown) == [2]
        assert named_actor(engine_actor_name(1), namespace)._actor_id == b._actor_id
        first, (second,) = router_deployment(grown)._bound_deployment.init_args
        assert (first.engine_indexes, second.engine_indexes) == ((0, 2), (1,))
        assert reconcile_engines(config(1)) == []
        assert named_actor(engine_actor_name(2), namespace) is None
        assert not _placement_group_exists(engine_actor_name(2), namespace)
        assert named_actor(engine_actor_name(1), namespace)._actor_id == b._actor_id
    finally:
        stopped = stop_app(namespace, app_name="redeploy-test-app-two-models")
    assert stopped == [engine_actor_name(0), engine_actor_name(1)]


def test_a_redeploy_after_an_engine_died_replaces_only_that_one(ray_cluster, tiny_model_dir):
    """Per-engine flags, and engine 0 gone (killed, its restarts spent): the redeploy starts engine 0
    again and leaves engine 1 alone (a layout that put running engines first moved engine 1's
    flags to another index, and replaced it too)."""
    import ray

    namespace = "redeploy-test-one-died"
    config = ClusterConfig(model=str(tiny_model_dir), namespace=namespace, defaults=EngineSpec(
        num_gpu_blocks=32, max_model_len=128, num_cpus_per_worker=0.5), engines=[{"max_num_seqs": 4},
                                                                                  {"max_num_seqs": 8}])
    try:
        assert reconcile_engines(config) == [0, 1]
        second = named_actor(engine_actor_name(1), namespace)
        ray.kill(named_actor(engine_actor_name(0), namespace), no_restart=True)
        assert reconcile_engines(config.model_copy()) == [0]
        assert named_actor(engine_actor_name(1), namespace)._actor_id == second._actor_id
        assert ray.get(named_actor(engine_actor_name(0), namespace).engine_config.remote(),
                       timeout=60).scheduler.max_num_seqs == 4
    finally:
        stop_app(namespace, app_name="redeploy-test-app-one-died")
