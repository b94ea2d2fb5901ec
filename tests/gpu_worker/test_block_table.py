"""The persistent block table: rows and columns that grow, rows reused, and a runner's table kept
equal to what the scheduler allocated through preemption, resumption and finishing."""

from __future__ import annotations

import numpy as np

from gpu_worker.block_table import BlockTable
from tests.gpu_worker.utils import greedy_request, make_runner, make_scheduler, run_to_completion, save_tiny_model


def test_rows_and_columns_grow_and_freed_rows_come_back_empty():
    table = BlockTable(num_rows=2, num_cols=2)
    a = table.add([1, 2, 3])  # wider than the table: columns double (at least to fit)
    b = table.add([4])
    c = table.add([5, 6])  # a third row: rows double
    assert table.table.shape == (4, 4) and table.num_free == 1
    table.write(b, 1, [7, 8, 9, 10, 11])
    assert table.gather(np.array([a, b, c]), 3).tolist() == [[1, 2, 3], [4, 7, 8], [5, 6, 0]]
    assert table.gather(np.array([b]), 6).tolist() == [[4, 7, 8, 9, 10, 11]]
    table.free(a)
    again = table.add([12])
    assert again == a and table.gather(np.array([again]), 4).tolist() == [[12, 0, 0, 0]]


def test_the_runner_holds_what_the_scheduler_allocated(tmp_path):
    """Every step, each scheduled request's row holds exactly its blocks (a small pool forces
    preemptions, so rows are given back and taken again), and every row is free at the end."""
    runner = make_runner(save_tiny_model(tmp_path), num_blocks=12, block_size=4)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    for i in range(5):
        sched.add_request(greedy_request(f"r{i}", [(7 * i + j) % 256 for j in range(6 + 3 * i)], 12))
    seen = {"preempted": 0, "checked": 0}
    requests = runner.requests

    def execute(so):
        out = runner.execute_model(so)
        for req_id in so.num_scheduled_tokens:
            if req_id in requests.states:
                state = requests[req_id]
                row = requests.block_table.gather(np.array([state.table_row]), state.num_blocks)[0]
                assert row.tolist() == sched.kv_cache_manager.get_block_ids(req_id), req_id
                seen["checked"] += 1
        seen["preempted"] += len(so.preempted_req_ids)
        return out

    run_to_completion(sched, execute)
    runner.execute_model(sched.schedule())  # (the pass that tells the runner the last ones finished)
    assert seen["preempted"] and seen["checked"]
    assert len(requests) == 0 and requests.block_table.num_free == requests.block_table.table.shape[0]
