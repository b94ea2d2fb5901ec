"""Driver for the two-node test: joins an existing Ray cluster, pins one engine per node, serves requests
through the router, and prints a JSON report on the last line of stdout."""

from __future__ import annotations

import json
import sys

import httpx
import ray
from ray import serve

from cluster.config import ClusterConfig, EngineSpec
from tests.serve_cluster import serve_cluster


def main(address: str, model_dir: str) -> None:
    ray.init(address=address, namespace="llm-cluster", log_to_driver=False)
    config = ClusterConfig(
        model=model_dir, served_model_name="tiny", num_engines=2, routing_policy="round_robin",
        # Both engines may hand a prompt's KV on (kv_both): the client-driven legs below cross the nodes.
        defaults=EngineSpec(num_gpu_blocks=64, max_model_len=256, kv_transfer_config={"kv_role": "kv_both"}),
        # Engine i may only be placed where its node's custom resource is.
        engines=[EngineSpec(resources={"node_a": 0.5}), EngineSpec(resources={"node_b": 0.5})])
    report: dict = {}
    with serve_cluster(config) as served:
        texts = []
        for i in range(6):
            r = httpx.post(f"{served.base}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": f"Hello {i}", "max_tokens": 4, "temperature": 0})
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
        report["finished"] = [s.num_requests_finished for s in served.stats()]
        report["engine_nodes"] = [ray.get(e.actor.__ray_call__.remote(
            lambda _self: ray.get_runtime_context().get_node_id())) for e in served.engines]
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        report["engine_node_resources"] = [sorted(k for k in nodes[n] if k.startswith("node_"))
                                           for n in report["engine_nodes"]]
        report["num_nodes"] = len(nodes)
        report["texts"] = texts
        # Prefill/decode legs (vLLM's proxy protocol) through the round-robin router: the prefill on
        # engine 0 (node_a), the decode on engine 1 (node_b), reading the prompt's KV across the nodes;
        # then the same prompt whole, on engine 0.
        prompt = {"model": "tiny", "prompt": "Across two nodes, the prompt's KV moves " * 3, "temperature": 0,
                  "ignore_eos": True}
        prefill = httpx.post(f"{served.base}/v1/completions", timeout=60,
                             json=prompt | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        prefill.raise_for_status()
        decode = httpx.post(f"{served.base}/v1/completions", timeout=60,
                            json=prompt | {"max_tokens": 6, "kv_transfer_params": prefill.json()["kv_transfer_params"]})
        whole = httpx.post(f"{served.base}/v1/completions", timeout=60, json=prompt | {"max_tokens": 6})
        report["disaggregated"] = [decode.json()["choices"][0]["text"], whole.json()["choices"][0]["text"]]
        report["kv_blocks"] = [[s.kv_transfer_sent_blocks, s.kv_transfer_received_blocks] for s in served.stats()]
    # Pipeline parallelism across the nodes: one engine of two stages, a stage on each node (STRICT_SPREAD
    # bundles), hidden states going between the nodes every pass; the same prompt's answer.
    staged = ClusterConfig(model=model_dir, served_model_name="tiny", num_engines=1, defaults=EngineSpec(
        num_gpu_blocks=64, max_model_len=256, pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD",
        num_cpus_per_worker=0.5))
    with serve_cluster(staged) as served:
        answer = httpx.post(f"{served.base}/v1/completions", timeout=60, json=prompt | {"max_tokens": 6})
        answer.raise_for_status()
        report["pipeline_text"] = answer.json()["choices"][0]["text"]
        workers = ray.get(served.engines[0].actor.__ray_call__.remote(
            lambda self: self.service.engine.executor.workers))
        report["pipeline_worker_nodes"] = [ray.get(w.__ray_call__.remote(
            lambda _w: ray.get_runtime_context().get_node_id())) for w in workers]
    serve.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
