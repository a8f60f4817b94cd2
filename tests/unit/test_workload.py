"""bench/workload.py: trace loading, schedule shaping and the summary, on small CSVs."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> types.ModuleType:
    name = "sits_bench_workload"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "workload.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


wl = _load()

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_csv(tmp_path: Path, rows: list[tuple[str, int, int]]) -> Path:
    p = tmp_path / "trace.csv"
    p.write_text(HEADER + "".join(f"{t},{c},{g}\n" for t, c, g in rows))
    return p


def even_trace(n: int, gap_s: float, ctx: int = 100, gen: int = 10) -> list[object]:
    return [wl.TraceRow(i * gap_s, ctx, gen) for i in range(n)]


def test_load_sorts_and_makes_times_relative(tmp_path: Path) -> None:
    p = write_csv(tmp_path, [("2023-11-16 18:15:50.9951690", 396, 109),
                             ("2023-11-16 18:15:46.6805900", 374, 44),
                             ("2023-11-16 18:15:46.68059", 10, 1)])
    rows = wl.load_trace(p)
    assert [(r.context_tokens, r.generated_tokens) for r in rows] == [(374, 44), (10, 1),
                                                                      (396, 109)]
    assert rows[0].t_s == 0.0
    assert rows[1].t_s == pytest.approx(0.0, abs=1e-6)
    assert rows[2].t_s == pytest.approx(4.314579, abs=1e-6)  # seven fraction digits kept


def test_bad_traces_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(wl.WorkloadError, match="cannot read"):
        wl.load_trace(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(wl.WorkloadError, match="not an Azure LLM trace"):
        wl.load_trace(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text(HEADER)
    with pytest.raises(wl.WorkloadError, match="no rows"):
        wl.load_trace(empty)


def test_rate_scale_duration_and_max_requests() -> None:
    rows = even_trace(100, 1.0)
    p = wl.plan(rows, wl.Shaping(rate_scale=4.0, duration_s=5.0))
    assert [x.at_s for x in p] == pytest.approx([i * 0.25 for i in range(20)])
    assert len(wl.plan(rows, wl.Shaping(rate_scale=4.0, max_requests=7))) == 7
    skipped = wl.plan(rows, wl.Shaping(start_s=10.0, max_requests=3))
    assert [x.at_s for x in skipped] == [0.0, 1.0, 2.0]


def test_token_scale_and_clamps() -> None:
    rows = [wl.TraceRow(0.0, 1000, 300), wl.TraceRow(1.0, 2, 1)]
    p = wl.plan(rows, wl.Shaping(token_scale=0.5, max_prompt_tokens=400, max_output_tokens=100,
                                 min_prompt_tokens=4, min_output_tokens=2))
    assert [(x.prompt_tokens, x.max_tokens) for x in p] == [(400, 100), (4, 2)]
    p = wl.plan(rows, wl.Shaping(token_scale=0.1))
    assert [(x.prompt_tokens, x.max_tokens) for x in p] == [(100, 30), (1, 1)]


def test_rate_step_compresses_arrivals_after_t() -> None:
    p = wl.plan(even_trace(10, 1.0), wl.Shaping(rate_step_at_s=4.0, rate_step=2.0))
    assert [x.at_s for x in p] == pytest.approx([0, 1, 2, 3, 4, 4.5, 5, 5.5, 6, 6.5])
    # the duration bounds replay time, so the step lets more requests in
    assert len(wl.plan(even_trace(20, 1.0), wl.Shaping(duration_s=8.0, rate_step_at_s=4.0,
                                                       rate_step=2.0))) == 12


def test_mix_shift_multiplies_sizes_from_t() -> None:
    p = wl.plan(even_trace(6, 1.0, ctx=100, gen=10), wl.Shaping(mix_shift_at_s=3.0,
                                                                mix_shift=3.0))
    assert [(x.prompt_tokens, x.max_tokens) for x in p] == [(100, 10)] * 3 + [(300, 30)] * 3


def test_max_rps_caps_the_mean_rate() -> None:
    rows = even_trace(200, 0.1)  # 10 rps
    p = wl.plan(rows, wl.Shaping(max_rps=2.0, duration_s=20.0))
    rate = wl.mean_rate([x.at_s for x in p])
    assert 1.9 <= rate <= 2.0
    assert wl.mean_rate([x.at_s for x in wl.plan(rows, wl.Shaping(max_rps=50.0))]) == (
        pytest.approx(10.0))


def test_seeded_choices_are_reproducible_and_ids_unique() -> None:
    rows = even_trace(200, 0.1)
    s = wl.Shaping(stream_fraction=0.5, api="mix", seed=7, id_prefix="x")
    a, b = wl.plan(rows, s), wl.plan(rows, s)
    assert a == b
    assert 60 < sum(x.stream for x in a) < 140
    assert {x.api for x in a} == {"chat", "completions"}
    assert len({x.request_id for x in a}) == len(a)
    assert wl.plan(rows, wl.Shaping(stream_fraction=0.5, api="mix", seed=8)) != a
    assert not any(x.stream for x in wl.plan(rows, wl.Shaping(stream_fraction=0.0)))


def test_prompt_text_has_exactly_the_planned_words() -> None:
    p = wl.plan([wl.TraceRow(0.0, 37, 5)], wl.Shaping())[0]
    text = wl.prompt_text(p, seed=3)
    assert len(text.split()) == 37
    assert wl.prompt_text(p, seed=3) == text != wl.prompt_text(p, seed=4)


@pytest.mark.parametrize("bad", [
    {"rate_scale": 0.0}, {"max_rps": -1.0}, {"stream_fraction": 1.5}, {"api": "grpc"},
    {"min_prompt_tokens": 10, "max_prompt_tokens": 5},
])
def test_bad_shaping_is_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(wl.WorkloadError):
        wl.plan(even_trace(3, 1.0), wl.Shaping(**bad))


def rec(i: int, ttft: float | None, latency: float, tokens: int, status: int = 200) -> object:
    r = wl.Record(f"r{i}", "chat", ttft is not None, float(i), 10, tokens)
    r.start_unix_ns = i * 1_000_000_000
    r.end_unix_ns = r.start_unix_ns + int(latency * 1e9)
    r.ttft_s, r.latency_s, r.content_tokens, r.status = ttft, latency, tokens, status
    return r


def test_summary_percentiles_and_goodput() -> None:
    records = [rec(0, 0.1, 1.0, 10), rec(1, 0.2, 1.1, 10), rec(2, 0.9, 1.8, 10),
               rec(3, None, 0.3, 5), rec(4, 0.1, 2.0, 10, status=500)]
    s = wl.summarize(records, slo_ttft_s=0.5, slo_tpot_s=0.15)
    assert (s["requests"], s["ok"], s["errors"]) == (5, 4, 1)
    assert s["wall_s"] == pytest.approx(6.0)  # 0 s to 4 s + 2 s
    assert s["ttft_s"]["p50"] == 0.2 and s["ttft_s"]["p99"] == 0.9
    assert s["latency_s"]["p50"] == 1.0 and s["latency_s"]["p95"] == 1.8
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)
    # r0, r1 meet it; r2 misses TTFT; r3 (not streamed) meets TTFT with its whole latency; r4 failed
    assert s["slo_attainment"] == pytest.approx(3 / 5)
    assert s["goodput_rps"] == pytest.approx(3 / 6.0)
    tight = wl.summarize(records, slo_ttft_s=0.5, slo_tpot_s=0.09)
    assert tight["slo_attainment"] == pytest.approx(1 / 5)  # only r3: TPOT not measurable


def test_percentile_is_nearest_rank() -> None:
    assert wl.percentile([], 50) is None
    assert wl.percentile([5.0], 99) == 5.0
    v = [float(i) for i in range(1, 101)]
    assert (wl.percentile(v, 50), wl.percentile(v, 95), wl.percentile(v, 99)) == (50.0, 95.0,
                                                                                   99.0)


def test_cli_needs_a_bound_and_reports_user_errors(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    assert wl.main(["--trace", str(tmp_path / "none.csv")]) == 2
    assert "give --duration or --max-requests" in capsys.readouterr().err
    assert wl.main(["--trace", str(tmp_path / "none.csv"), "--duration", "1"]) == 2
    assert capsys.readouterr().err.startswith("workload: cannot read trace")
    p = write_csv(tmp_path, [("2023-11-16 18:15:46.0", 10, 2), ("2023-11-16 18:15:47.0", 10, 2)])
    assert wl.main(["--trace", str(p), "--duration", "5", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("2 requests over 1.0s")
