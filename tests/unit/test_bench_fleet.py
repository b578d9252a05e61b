"""The pure parts of ``bench fleet``: reading a daemon's page, summing the fleet's saturation as
Prometheus' ``sum`` does, the table, and the router's command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.bench.experiments.fleet import Step, autopilot_figures, format_table, summarize_readings
from controller.bench.router import router_argv

PAGE = """\
# HELP autopilot_saturation Offered requests/s over autopilot_capacity_rps.
# TYPE autopilot_saturation gauge
autopilot_saturation 0.75
# HELP autopilot_capacity_rps Good requests per second this replica can serve.
# TYPE autopilot_capacity_rps gauge
autopilot_capacity_rps 4.5
# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
"""


def test_a_page_gives_saturation_and_capacity_and_nothing_else() -> None:
    assert autopilot_figures(PAGE) == {"saturation": 0.75, "capacity_rps": 4.5}


def test_a_gauge_without_a_sample_is_absent() -> None:
    assert autopilot_figures("# TYPE autopilot_saturation gauge\n") == {}


def test_the_sum_covers_the_daemons_with_a_sample_as_prometheus_sum_does() -> None:
    readings = [
        [{"saturation": 0.5}, {"saturation": 0.7}],
        [{"saturation": 0.6}, {}],  # b has no figure yet: the sum is a's alone
        [{}, {}],  # neither: no sum at all, not a 0
    ]
    total, each = summarize_readings(readings, "saturation")
    assert total == (1.2 + 0.6) / 2
    assert each == [(0.5 + 0.6) / 2, 0.7]


def test_no_readings_give_no_figures() -> None:
    assert summarize_readings([], "saturation") == (None, [])


def test_the_table_has_a_row_per_step_and_a_dash_for_a_missing_figure() -> None:
    steps = [
        Step(0.5, 4.0, 0.52, [0.25, 0.27], 8.1, 4.0, 0.0, 200, 200, 198, 0, 0),
        Step(1.5, 12.0, None, [None, 1.4], None, 19.5, 6.25, 600, 420, 400, 180, 0),
    ]
    rows = format_table(8.0, steps).splitlines()
    assert len(rows) == 4 and "C = 8.00 req/s" in rows[0]
    assert rows[2].split("|")[1:6] == [" 0.50 ", " 4.00 ", " 0.52 ", " 0.25 ", " 0.27 "]
    assert rows[3].split("|")[3:5] == [" - ", " - "]
    assert rows[3].split("|")[7:9] == [" 19.50 ", " 6.25 "]
    assert all(row.count("|") == 14 for row in rows)


def test_the_router_runs_round_robin_over_the_workers_with_the_recipes_breaker() -> None:
    launcher = pytest.importorskip(
        "vllm_router.launch_router",
        reason="vllm-router is not installed: pip install 'vllm-autopilot[fleet]'",
    )
    workers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    argv = router_argv(Path("/bin/vllm-router"), 8080, workers, "round_robin", 29000)
    args = launcher.parse_router_args(argv[1:])  # read by the router's own parser
    assert args.worker_urls == workers and args.policy == "round_robin"
    assert args.cb_failure_threshold == 3 and args.port == 8080 and args.prometheus_port == 29000
