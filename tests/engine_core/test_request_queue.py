from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue


def _req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1], SamplingParams(), priority=priority, arrival_time=arrival)


def test_fcfs_queue_front_and_back_are_literal_positions():
    q = FCFSRequestQueue()
    a, b, c, d = _req("a"), _req("b"), _req("c"), _req("d")
    q.add_request(a)
    q.add_request(b)
    q.prepend_request(c)
    assert [r.request_id for r in q] == ["c", "a", "b"]
    assert q.peek_request() is c and q.pop_request() is c
    other = FCFSRequestQueue()
    other.prepend_request(d)
    other.prepend_request(c)  # (taken d, then c: prepending leaves them c, d)
    q.prepend_requests(other)
    assert [r.request_id for r in q] == ["d", "c", "a", "b"]  # (back in the order they were taken)
    q.remove_requests([c, b])
    assert [r.request_id for r in q] == ["d", "a"] and a in q and b not in q and len(q) == 2
    q.remove_request(d)
    assert list(q) == [a]


def test_priority_queue_orders_by_priority_then_arrival_and_prepend_is_an_insert():
    q = PriorityRequestQueue()
    late_urgent, early_normal, late_normal = _req("x", 0, 5.0), _req("y", 1, 1.0), _req("z", 1, 2.0)
    for r in (late_normal, early_normal):
        q.add_request(r)
    q.prepend_request(late_urgent)  # no meaning in a heap: an ordinary insert
    assert [r.request_id for r in q] == ["x", "y", "z"]
    assert q.peek_request() is late_urgent and q.pop_request() is late_urgent
    demoted = _req("w", 9, 0.0)
    q.prepend_request(demoted)  # prepending a low-priority request does not put it first
    assert q.peek_request() is early_normal
    q.remove_requests([early_normal])
    assert [r.request_id for r in q] == ["z", "w"] and early_normal not in q


def test_priority_ties_break_on_request_id():
    q = PriorityRequestQueue()
    q.add_request(_req("b", 0, 1.0))
    q.add_request(_req("a", 0, 1.0))
    assert q.pop_request().request_id == "a"
