"""GET /health's verdict (serve_app/http/health.py): 503 while a model has no ready worker
replica, unless its autoscaling may go to zero (its first request starts one)."""

from __future__ import annotations

from serve_app.http.health import ModelHealth, health_report


def test_every_model_with_a_replica_is_ok():
    status, body = health_report({"a": ModelHealth(2, False), "b": ModelHealth(1, False)})
    assert status == 200 and body["status"] == "ok"
    assert body["models"] == {"a": {"ready_replicas": 2, "ready": True}, "b": {"ready_replicas": 1, "ready": True}}


def test_a_model_without_a_replica_makes_it_unavailable():
    status, body = health_report({"a": ModelHealth(1, False), "b": ModelHealth(0, False)})
    assert status == 503 and body["status"] == "unavailable"
    assert body["models"]["b"] == {"ready_replicas": 0, "ready": False}


def test_a_model_scaled_to_zero_is_ready_with_none():
    status, body = health_report({"a": ModelHealth(0, True)})
    assert status == 200 and body["models"]["a"] == {"ready_replicas": 0, "ready": True}
