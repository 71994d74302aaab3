"""Each metric a kvlab replica serves is declared in vLLM 0.33.0's ``vllm/v1/metrics/loggers.py`` with the
same type, label names and buckets; read from that file's source (its ``_gauge_cls`` / ``_counter_cls`` /
``_histogram_cls`` calls) and from vLLM's own ``histogram_buckets``."""

from __future__ import annotations

import ast
import inspect

import pytest

pytest.importorskip("vllm.v1.metrics.loggers", reason="vLLM 0.33.0 is not installed here: run make test-vllm")

from vllm.v1.metrics import loggers  # noqa: E402
from vllm.v1.metrics.buckets import histogram_buckets  # noqa: E402

from kvlab.fleet.metrics import declared_metrics  # noqa: E402

KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}


def vllm_declared() -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]]:
    tree = ast.parse(inspect.getsource(loggers))
    bucket_keys: dict[str, str] = {}  # variable -> histogram_buckets' key
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "histogram_buckets"):
            bucket_keys[node.targets[0].id] = node.value.args[0].value
    out = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KINDS):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        labels: tuple[str, ...] = ()
        label_node = kw.get("labelnames")
        if isinstance(label_node, ast.Name) and label_node.id == "labelnames":
            labels = ("model_name", "engine")
        elif isinstance(label_node, ast.BinOp):
            labels = ("model_name", "engine", *(e.value for e in label_node.right.elts))
        buckets = None
        if isinstance(kw.get("buckets"), ast.Name) and kw["buckets"].id in bucket_keys:
            key = bucket_keys[kw["buckets"].id]
            buckets = tuple(float(b) for b in histogram_buckets(key)) if key != "request_tokens" else None
        if isinstance(kw.get("name"), ast.Constant):  # a few names are built at run time: not kvlab's
            out[kw["name"].value] = (KINDS[node.func.attr], labels, buckets)
    return out


def test_every_kvlab_replica_metric_is_vllms_with_its_type_labels_and_buckets():
    theirs = vllm_declared()
    assert len(theirs) > 40  # the parse found vLLM's metric set
    for name, (kind, labels, buckets) in declared_metrics().items():
        assert name in theirs, name
        assert theirs[name][0] == kind, name
        assert theirs[name][1] == labels, name
        if buckets is not None:
            assert tuple(map(float, buckets)) == theirs[name][2], name


def test_the_metrics_the_issue_names_are_served():
    served = set(declared_metrics())
    assert {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions",
            "vllm:kv_block_lifetime_seconds", "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds"} <= served
