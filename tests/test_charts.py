"""tasks/charts.py: the throughput sparkline and per-server bars, and the artifact they make."""

from __future__ import annotations

import pytest

from tasks.charts import (
    SPARK,
    bar,
    human_duration,
    resample,
    sparkline,
    throughput_chart,
    throughput_markdown,
    tokens_table,
)


def test_sparkline_spans_lowest_to_highest_and_marks_gaps() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == SPARK
    assert sparkline([5, None, 5]) == "█ █"  # flat and non-zero: full height
    assert sparkline([]) == ""
    assert sparkline([0.0, 0.0]) == "▁▁"


def test_bar_uses_eighths() -> None:
    assert bar(100, 100, width=4) == "████"
    assert bar(50, 100, width=4) == "██"
    assert bar(1, 8 * 4, width=4) == "▏"     # one eighth of one character
    assert bar(0, 100) == "" and bar(5, 0) == ""


def test_resample_buckets_by_time_not_by_index() -> None:
    """Irregular samples: a burst of samples early must not squeeze the time axis."""
    series = [{"t": t, "tok_s": 10} for t in (0, 1, 2, 3)] + [{"t": 100, "tok_s": 30}]
    values, t0, t1 = resample(series, width=4)
    assert (t0, t1) == (0, 100)
    assert values == [10, None, None, 30]


def test_resample_skips_junk_and_sorts() -> None:
    series = [{"t": 20, "tok_s": 2}, {"t": 10, "tok_s": 1}, {"t": None, "tok_s": 5}, {"t": 15, "tok_s": "x"},
              {"t": 30, "tok_s": float("nan")}]
    values, t0, t1 = resample(series, width=60)
    assert (t0, t1) == (10, 20) and values == [1, 2]


def test_chart_labels_the_true_range_and_span() -> None:
    series = [{"t": i * 60, "tok_s": 1000 + i} for i in range(120)]
    chart = throughput_chart(series, width=40)
    lines = chart.splitlines()
    assert lines[0] == "```" and lines[-1] == "```"
    assert lines[1].startswith("1,118 tok/s ┤") or lines[1].startswith("1,119 tok/s ┤")
    assert "1,000 tok/s └" in lines[2] or "1,001 tok/s └" in lines[2]
    assert lines[3].rstrip().endswith("1 h 59 min") or lines[3].rstrip().endswith("119 min")
    assert len(lines[1].split("┤")[1]) == 40


@pytest.mark.parametrize("seconds,text", [(5, "5 s"), (600, "10 min"), (7200, "2 h 00 min"),
                                          (3 * 86400, "3.0 days")])
def test_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def test_tokens_table_accepts_mapping_or_rows() -> None:
    a = tokens_table({"n/0": 300, "n/1": 100})
    b = tokens_table([{"server": "n/0", "tokens": 300}, {"server": "n/1", "tokens": 100}])
    assert a == b
    assert "| n/0 | 300 | 75.0% |" in a and "| **total** | **400** |" in a


def test_markdown_with_no_data_says_so() -> None:
    md = throughput_markdown([], {})
    assert "_no throughput samples yet_" in md and "_no tokens yet_" in md


def test_markdown_stats_line() -> None:
    md = throughput_markdown([{"t": 0, "tok_s": 100}, {"t": 10, "tok_s": 300}], {"a": 5})
    assert "mean **200**, peak 300, last 300; 2 samples" in md


@pytest.mark.usefixtures("prefect_api")
def test_artifact_written_under_a_stable_key() -> None:
    import asyncio

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from fleet.config import FleetConfig
    from tasks.charts import write_throughput_artifact

    cfg = FleetConfig(name="chart-t")

    @flow
    def gen() -> str:
        return write_throughput_artifact(cfg, [{"t": 0, "tok_s": 50}, {"t": 60, "tok_s": 70}], {"local/0": 1234})

    md = gen()

    async def read():
        async with get_client() as client:
            return await client.read_latest_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["chart-t-generation-throughput"])))

    arts = asyncio.run(read())
    assert len(arts) == 1 and arts[0].data == md and "1,234" in md
