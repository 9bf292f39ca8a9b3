"""The report's table: swept params found, success with its interval, cost only where a price is set."""

from rlexp.tasks.report import RunSummary, _swept_keys, format_table


def _summary(name, swept, cost=None):
    return RunSummary(
        name=name, status="FINISHED", swept=swept, curve=[(0, 0.25, 0.15, 0.38), (10, 0.5, 0.38, 0.62)],
        turn_limit=15.0, hours=2.0, gpu_hours=12.0, cost=cost,
    )


def test_swept_keys_are_the_params_that_differ():
    params = [{"a": "1", "b": "x", "run_name": "r1"}, {"a": "2", "b": "x", "run_name": "r2"}]
    assert _swept_keys(params) == ["a"]


def test_table_shows_final_and_best_success_with_interval_and_turn_limit():
    table = format_table([_summary("r1", {"algorithm.lr": "0.1"})], ["algorithm.lr"]).splitlines()
    assert table[0] == "| run | algorithm.lr | status | final success [95% CI] | best | turns | GPU-h |"
    assert table[2] == "| r1 | 0.1 | FINISHED | 50.0% [38.0%, 62.0%] @ step 10 | 50.0% | ≤15 | 12.00 |"


def test_cost_column_only_when_a_price_is_set():
    with_price = format_table([_summary("r1", {}, cost=64.0), _summary("r2", {})], []).splitlines()
    assert with_price[0].endswith("| GPU-h | cost $ |")
    assert with_price[2].endswith("| 12.00 | 64.00 |") and with_price[3].endswith("| 12.00 | - |")
