"""Metric tables for root-cause ranking: read and check them, and walk a case folder.

A metric table is a CSV file whose first column is the sample time and whose other
columns are numeric metrics, one row per sample (a Prometheus range query exported
to CSV has this shape). A fault case is a pair of such tables with the same columns:
one recorded before the fault (normal) and one while it lasted (anomalous).

`load_table` raises `ValueError` with one line that names the file and the problem;
the CLI prints that line and exits non-zero.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

TIME_COLUMN = "time"


@dataclass(frozen=True)
class Case:
    """One labelled fault: the tables before and during it and its true root cause."""

    name: str
    service: str
    fault: str
    normal: pd.DataFrame
    anomalous: pd.DataFrame


def load_table(path: str | Path) -> pd.DataFrame:
    """Read a metric table; the first column must be `time`, the others numeric.

    Columns that hold no number at all (a label such as a host name) are dropped;
    a column that is numeric but for a few cells is an error naming the first bad cell.
    """
    p = Path(path)
    raw = _read_csv(p)
    if raw.columns[0].strip().lower() != TIME_COLUMN:
        raise ValueError(f"{p}: the first column must be 'time', not {raw.columns[0]!r}")
    if len(raw) == 0:
        raise ValueError(f"{p}: the table has a header but no rows")
    table = _numeric_metrics(raw.rename(columns={raw.columns[0]: TIME_COLUMN}), p)
    if table.shape[1] < 2:
        raise ValueError(f"{p}: no numeric metric columns besides 'time'")
    return table


def _read_csv(p: Path) -> pd.DataFrame:
    if not p.is_file():
        raise ValueError(f"{p}: no such file")
    try:
        return pd.read_csv(p)
    except pd.errors.EmptyDataError:
        raise ValueError(f"{p}: the file is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{p}: not a readable CSV table ({first})") from None


def _numeric_metrics(raw: pd.DataFrame, p: Path) -> pd.DataFrame:
    keep: dict[str, pd.Series] = {TIME_COLUMN: raw[TIME_COLUMN]}
    for col in raw.columns[1:]:
        if pd.api.types.is_numeric_dtype(raw[col]):
            keep[str(col)] = raw[col].astype(float)
            continue
        values = pd.to_numeric(raw[col], errors="coerce")
        bad = values.isna() & raw[col].notna()
        if bad.all():
            continue  # a label column: nothing numeric to rank
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            raise ValueError(
                f"{p}: column {col!r} is not numeric at data row {row + 1} ({raw[col].iloc[row]!r})"
            )
        keep[str(col)] = values.astype(float)
    return pd.DataFrame(keep)


def check_same_columns(normal: pd.DataFrame, anomalous: pd.DataFrame) -> None:
    """Raise ValueError when the two windows do not hold the same metric columns."""
    only_n = [c for c in normal.columns if c not in anomalous.columns]
    only_a = [c for c in anomalous.columns if c not in normal.columns]
    if only_n or only_a:
        raise ValueError(
            "the normal and anomalous tables have different columns: "
            f"only in normal {_few(only_n)}, only in anomalous {_few(only_a)}"
        )


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit]) or "none"
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def unpack_archive(archive: Path, dest: Path) -> Path:
    """Extract a .tar.* archive into dest, refusing links and paths that leave dest."""
    if not archive.is_file():
        raise ValueError(f"{archive}: no such archive")
    root = dest.resolve()
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        for m in members:
            if not (root / m.name).resolve().is_relative_to(root):
                raise ValueError(f"{archive}: member {m.name!r} would land outside {dest}")
        tar.extractall(root, members=members)
    return root


def iter_cases(root: Path) -> Iterator[Case]:
    """Yield the cases under root laid out as `<service>-<fault>/<n>/{normal,anomalous}.csv`."""
    for normal_csv in sorted(root.glob("**/normal.csv")):
        case_dir = normal_csv.parent
        service, _, fault = case_dir.parent.name.rpartition("-")
        if not service:
            raise ValueError(f"{case_dir.parent}: folder name is not <service>-<fault>")
        yield Case(
            name=f"{case_dir.parent.name}/{case_dir.name}",
            service=service,
            fault=fault,
            normal=load_table(normal_csv),
            anomalous=load_table(case_dir / "anomalous.csv"),
        )
