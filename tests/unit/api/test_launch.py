"""serve_app.launch: `serve run`'s arguments pass through unchanged, and the Ray it starts
gets the dashboard choice (off unless --dashboard); ray.init is restored afterwards. The
launcher started for real: tests/serve/test_http_edge.py."""

from __future__ import annotations

import pytest
import ray

from serve_app import launch


def test_only_the_dashboard_flag_is_taken_from_serve_runs_arguments():
    assert launch.parse_args(["configs/default.yaml"]) == (False, ["configs/default.yaml"])
    assert launch.parse_args(["--dashboard", "c.yaml", "--address", "auto", "-n", "x"]) == (
        True, ["c.yaml", "--address", "auto", "-n", "x"])
    assert launch.parse_args(["c.yaml", "--dashboard"]) == (True, ["c.yaml"])


@pytest.mark.parametrize("argv, dashboard", [(["c.yaml"], False), (["--dashboard", "c.yaml"], True)])
def test_serve_runs_ray_init_gets_the_dashboard_choice(monkeypatch, argv, dashboard):
    inits = []

    def recording_init(*args, **kwargs):
        inits.append((args, kwargs))

    def serve(args, prog_name):  # what `serve run` does first: ray.init with its own arguments
        start = ray.init  # as the launcher set it, over the recording fake: no Ray starts
        start(address=None, namespace="serve")
        return args, prog_name

    monkeypatch.setattr(ray, "init", recording_init)
    assert launch.main(argv, serve=serve) == (["run", "c.yaml"], "serve")
    assert inits == [((), {"address": None, "namespace": "serve", "include_dashboard": dashboard})]
    assert ray.init is recording_init  # restored


def test_an_explicit_choice_of_the_caller_stands_and_init_is_restored_after_a_failure(monkeypatch):
    inits = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append(kwargs))
    original = ray.init

    def failing_serve(args, prog_name):
        start = ray.init  # the launcher's, over the recording fake
        start(include_dashboard=True)
        raise SystemExit(1)

    with pytest.raises(SystemExit):
        launch.main(["c.yaml"], serve=failing_serve)
    assert inits == [{"include_dashboard": True}] and ray.init is original
