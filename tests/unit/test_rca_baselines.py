"""Root-cause ranking of metric tables (analyzers/baselines.py, analyzers/tables.py).

Synthetic tables built here, plus one run on the public Sock Shop 1 data when it is
present next to the repository (../shared/data): there the reproduced BARO and
NSigma service-level Avg@5 must be within 0.03 of RCAEval's published values.
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sits_trace.analyzers.baselines import (
    accuracy,
    evaluate,
    rank_random,
    rank_table,
    scaled_max,
    service_rank,
)
from sits_trace.analyzers.tables import Case, iter_cases, load_table, unpack_archive
from sklearn.preprocessing import RobustScaler, StandardScaler

SOCKSHOP = Path(__file__).resolve().parents[3] / "shared" / "data" / "rcaeval-sockshop1.tar.xz"
METHODS = ("sits", "baro", "nsigma")


def windows(
    n: int = 200, seed: int = 1, **anomalous_shift: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Five noisy metrics (mean 10, sd 1); the anomalous window adds each shift to its column."""
    rng = np.random.default_rng(seed)
    cols = ["a_cpu", "b_cpu", "c_cpu", "d_lod", "e_lat_90"]

    def frame(t0: int, shift: dict[str, float]) -> pd.DataFrame:
        data = {c: 10 + rng.normal(0, 1, n) + shift.get(c, 0.0) for c in cols}
        return pd.DataFrame({"time": np.arange(t0, t0 + n), **data})

    return frame(0, {}), frame(n, anomalous_shift)


def names(ranking: list[tuple[str, float]]) -> list[str]:
    return [m for m, _ in ranking]


@pytest.mark.parametrize("method", METHODS)
def test_a_column_that_jumps_ranks_first(method: str) -> None:
    normal, anomalous = windows(c_cpu=8.0)
    ranking = rank_table(normal, anomalous, method)
    assert names(ranking)[0] == "c_cpu"
    assert "time" not in names(ranking)
    assert ranking == sorted(ranking, key=lambda p: -p[1])


@pytest.mark.parametrize("method", ["baro", "nsigma"])
def test_signed_scores_put_a_drop_below_a_rise_of_the_same_size(method: str) -> None:
    normal, anomalous = windows(b_cpu=-8.0, d_lod=8.0)
    signed = names(rank_table(normal, anomalous, method))
    assert signed[0] == "d_lod"
    assert signed[-1] == "b_cpu"  # only drops: its max scaled value is the lowest
    unsigned = names(rank_table(normal, anomalous, method, signed=False))
    assert set(unsigned[:2]) == {"b_cpu", "d_lod"}


def test_sits_ranks_a_drop_below_a_rise_but_above_noise() -> None:
    normal, anomalous = windows(b_cpu=-8.0, d_lod=8.0)
    assert names(rank_table(normal, anomalous, "sits"))[:2] == ["d_lod", "b_cpu"]


def test_flat_columns_are_left_out() -> None:
    normal, anomalous = windows(c_cpu=8.0)
    for df in (normal, anomalous):
        df["flat_mem"] = 5.0
    for method in METHODS:
        assert "flat_mem" not in names(rank_table(normal, anomalous, method))


def test_a_column_flat_before_the_fault() -> None:
    normal, anomalous = windows(c_cpu=8.0)
    normal["x_cpu"] = 0.0
    anomalous["x_cpu"] = np.linspace(0.0, 50.0, len(anomalous))
    # RCAEval drops a column constant inside either window; sits keeps and ranks it.
    assert "x_cpu" not in names(rank_table(normal, anomalous, "baro"))
    ranking = rank_table(normal, anomalous, "sits")
    assert "x_cpu" in names(ranking)[:2]
    assert all(np.isfinite(s) for _, s in ranking)


@pytest.mark.parametrize("robust", [True, False])
def test_scaled_max_matches_scikit_learn_scalers(robust: bool) -> None:
    rng = np.random.default_rng(7)
    normal = rng.normal(0, 3, (120, 4))
    normal[:, 3] = np.where(np.arange(120) < 115, 2.0, 3.0)  # zero IQR, non-zero std
    anomalous = rng.normal(1, 3, (80, 4))
    scaler = RobustScaler if robust else StandardScaler
    expected = [scaler().fit(normal[:, [j]]).transform(anomalous[:, [j]]).max() for j in range(4)]
    np.testing.assert_allclose(scaled_max(normal, anomalous, robust=robust), expected)


def test_baro_reads_mem_columns_in_mb_as_rcaeval_does() -> None:
    normal, anomalous = windows(c_cpu=8.0)
    normal["q_mem"] = np.where(np.arange(len(normal)) % 50 == 0, 2e8 + 4096, 2e8)
    # a 1.5% step on a column whose IQR is zero
    anomalous["q_mem"] = normal["q_mem"].to_numpy() + 3e6
    in_mb = dict(rank_table(normal, anomalous, "baro"))
    in_bytes = dict(rank_table(normal, anomalous, "baro", mem_mb=False))
    assert in_mb["q_mem"] == pytest.approx(3.004096)  # (max - median) / 1, in MB
    assert in_bytes["q_mem"] == pytest.approx(3.004096e6)
    assert names(rank_table(normal, anomalous, "baro", mem_mb=False))[0] == "q_mem"


def test_sits_does_not_depend_on_units() -> None:
    normal, anomalous = windows(c_cpu=8.0)
    normal["q_mem"] = np.where(np.arange(len(normal)) % 50 == 0, 2e8 + 4096, 2e8)
    anomalous["q_mem"] = normal["q_mem"].to_numpy() + 3e6
    before = rank_table(normal, anomalous, "sits")
    for df in (normal, anomalous):
        df["q_mem"] = df["q_mem"] / 1e6
        df["d_lod"] = df["d_lod"] * 1000
    after = rank_table(normal, anomalous, "sits")
    assert names(before) == names(after)
    assert names(after)[0] == "c_cpu"  # a 1.5% memory step is not the cause
    np.testing.assert_allclose([s for _, s in before], [s for _, s in after])


def test_missing_values_are_forward_filled() -> None:
    normal, anomalous = windows(c_cpu=8.0)
    normal.loc[10:20, "a_cpu"] = np.nan
    anomalous.loc[0:5, "c_cpu"] = np.inf
    for method in METHODS:
        ranking = rank_table(normal, anomalous, method)
        assert names(ranking)[0] == "c_cpu"
        assert all(np.isfinite(s) for _, s in ranking)


def test_mismatched_columns_and_unknown_method_are_value_errors() -> None:
    normal, anomalous = windows()
    with pytest.raises(ValueError, match="different columns.*only in anomalous 'z_cpu'"):
        rank_table(normal, anomalous.assign(z_cpu=1.0), "baro")
    with pytest.raises(ValueError, match="unknown method 'pc'"):
        rank_table(normal, anomalous, "pc")
    with pytest.raises(ValueError, match="anomalous table has no rows"):
        rank_table(normal, anomalous.iloc[:0], "sits")


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no such file"),
        ("", "the file is empty"),
        ("time,a_cpu\n", "header but no rows"),
        ("ts,a_cpu\n1,2\n", "first column must be 'time'"),
        ("time,host\n1,node-a\n2,node-b\n", "no numeric metric columns"),
        ("time,a_cpu\n1,2\n2,oops\n", "column 'a_cpu' is not numeric at data row 2 .'oops'."),
        ('time,a\n1,"2\n', "not a readable CSV"),
    ],
)
def test_bad_files_give_one_line_value_errors(
    tmp_path: Path, text: str | None, message: str
) -> None:
    path = tmp_path / "missing.csv" if text is None else _write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as err:
        load_table(path)
    assert "\n" not in str(err.value)
    assert str(path) in str(err.value)


def test_load_table_keeps_time_and_numbers_and_drops_labels(tmp_path: Path) -> None:
    path = _write(tmp_path, "Time,host,a_cpu,b_mem\n1,n1,0.5,100\n2,n1,,200\n")
    table = load_table(path)
    assert list(table.columns) == ["time", "a_cpu", "b_mem"]
    assert table["b_mem"].tolist() == [100.0, 200.0]


def test_service_rank_uses_the_best_metric_of_a_service() -> None:
    ranking = [("carts-db_mem", 9.0), ("orders_cpu", 8.0), ("carts_cpu", 7.0), ("user_mem", 6.0)]
    assert service_rank(ranking, "orders") == 2
    assert service_rank(ranking, "carts") == 3
    assert service_rank(ranking, "carts", fold_db=True) == 1
    assert service_rank(ranking, "user", fold_db=True) == 3
    assert service_rank(ranking, "payment") is None


def test_accuracy_at_k_and_avg5() -> None:
    acc = accuracy([1, 2, 6, None])
    assert acc.ac == (0.25, 0.5, 0.5, 0.5, 0.5)
    assert acc.avg5 == pytest.approx(0.45)


def test_random_ranking_is_seeded() -> None:
    cols = [f"s{i}_cpu" for i in range(10)]
    first = rank_random(cols, np.random.default_rng(3))
    assert first == rank_random(cols, np.random.default_rng(3))
    assert sorted(names(first)) == sorted(cols)


def _tar_with(tmp_path: Path, files: dict[str, str]) -> Path:
    archive = tmp_path / "cases.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def _case_csv(shift: float) -> str:
    rows = [f"{t},{1 + (t % 3) * 0.1 + shift},{5 + (t % 2) * 0.2}" for t in range(30)]
    return "time,carts_cpu,user_cpu\n" + "\n".join(rows) + "\n"


def test_cases_unpack_and_evaluate(tmp_path: Path) -> None:
    archive = _tar_with(
        tmp_path,
        {
            "data/carts-cpu/1/normal.csv": _case_csv(0.0),
            "data/carts-cpu/1/anomalous.csv": _case_csv(50.0),
        },
    )
    cases = list(iter_cases(unpack_archive(archive, tmp_path / "out")))
    assert [(c.name, c.service, c.fault) for c in cases] == [("carts-cpu/1", "carts", "cpu")]
    result = evaluate(cases, lambda c: rank_table(c.normal, c.anomalous, "baro"))
    assert result["cpu"].ac == (1.0,) * 5


def test_unpack_refuses_paths_that_leave_the_folder(tmp_path: Path) -> None:
    archive = _tar_with(tmp_path, {"../evil.csv": "time,a\n1,2\n"})
    with pytest.raises(ValueError, match="outside"):
        unpack_archive(archive, tmp_path / "out")
    assert not (tmp_path / "evil.csv").exists()


@pytest.mark.skipif(not SOCKSHOP.is_file(), reason=f"{SOCKSHOP} is absent")
def test_sock_shop_1_reproduces_published_avg5(tmp_path: Path) -> None:
    start = time.monotonic()
    cases: list[Case] = list(iter_cases(unpack_archive(SOCKSHOP, tmp_path)))
    assert len(cases) == 50
    published = {"baro": {"cpu": 0.99, "mem": 0.99}, "nsigma": {"cpu": 0.98, "mem": 0.99}}
    measured = {}
    for method in ("baro", "nsigma", "sits"):
        measured[method] = evaluate(
            cases, lambda c, m=method: rank_table(c.normal, c.anomalous, m), fold_db=True
        )
    for method, by_fault in published.items():
        for fault, value in by_fault.items():
            assert measured[method][fault].cases == 25
            assert abs(measured[method][fault].avg5 - value) <= 0.03, (method, fault)
    for fault in ("cpu", "mem"):
        assert measured["sits"][fault].avg5 >= measured["baro"][fault].avg5
    assert time.monotonic() - start < 60
