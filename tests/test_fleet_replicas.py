"""Replicas as processes: they agree with the fleet simulation request by request, publish vLLM-format events
over ZMQ, serve /metrics over HTTP, and a replica killed mid-run is reported while its requests are re-routed.
The replicas here are the no-compute ones, cheap to start; ``test_fleet_engine_replicas.py`` runs ``LLMEngine``s.
"""

from __future__ import annotations

import pytest

from kvlab.errors import KvlabValueError
from kvlab.fleet.metrics import parse_scrape
from kvlab.fleet.replica import ReplicaFleet, alive
from kvlab.fleet.routers import make_router
from kvlab.fleet.serving import serve_timed
from kvlab.fleet.simulation import customer_workload, simulate_fleet

WORKLOAD = customer_workload(num_customers=6, queries_per_customer=6, context_tokens=128, query_tokens=16, seed=2)


@pytest.fixture(scope="module")
def fleet():
    with ReplicaFleet(3, num_blocks=40, block_size=16, timeout=60) as f:
        yield f
    assert all(not h.process.is_alive() for h in f.handles) or not f.handles


def same_service(a, b):
    return [(s.replica, s.hit_tokens, s.prefilled_tokens) for s in a.served] == [
        (s.replica, s.hit_tokens, s.prefilled_tokens) for s in b.served]


def test_the_processes_serve_what_the_simulation_serves_request_by_request(fleet):
    simulated = simulate_fleet(make_router("precise", 3), WORKLOAD, num_blocks=40)
    fleet.reset()
    measured = simulate_fleet(make_router("precise", 3), WORKLOAD, num_blocks=40, backend=fleet)
    assert same_service(simulated, measured) and measured.prediction_error_tokens == 0
    scrape = parse_scrape(fleet.scrape(0))
    hits = sum(s.hit_tokens for s in measured.served if s.replica == 0)
    assert scrape["vllm:prefix_cache_hits_total"] >= hits > 0  # counters since start: this run's hits included


def test_a_timed_run_sends_every_request_once_and_reads_the_events_as_they_arrive(fleet):
    fleet.reset()
    for closed_loop in (False, True):
        fleet.reset()
        run = serve_timed(make_router("precise", 3), WORKLOAD, fleet, time_scale=0.01, closed_loop=closed_loop,
                          timeout=60)
        assert [m.request_id for m in run.requests] == [r.request_id for r in WORKLOAD]
        assert all(m.rerouted == 0 and m.hit_tokens + m.prefilled_tokens == len(r.prompt_token_ids)
                   for m, r in zip(run.requests, WORKLOAD, strict=True))
        assert run.hit_rate > 0 and sum(run.requests_per_replica) == len(WORKLOAD)
    with pytest.raises(KvlabValueError, match="router"):
        serve_timed(make_router("precise", 2), WORKLOAD, fleet)


def test_a_killed_replica_is_reported_and_its_requests_rerouted_none_lost(fleet):
    fleet.reset()
    result = simulate_fleet(make_router("round_robin", 3), WORKLOAD, num_blocks=40, backend=fleet,
                            before_each=lambda k: fleet.kill(1) if k == 10 else None)
    assert result.dead == [1] and fleet.dead == [1] and alive(fleet) == [0, 2]
    assert [s.request_id for s in result.served] == [r.request_id for r in WORKLOAD]  # every request served
    assert all(s.replica != 1 for s in result.served[10:])
    fleet.reset()  # a later timed run leaves the dead replica out from the start
    run = serve_timed(make_router("round_robin", 3), WORKLOAD, fleet, time_scale=0.01, timeout=60)
    assert run.dead == [1] and 1 not in {m.replica for m in run.requests} and len(run.requests) == len(WORKLOAD)
