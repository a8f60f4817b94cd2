"""Root-cause ranking accuracy on Sock Shop 1 (RCAEval's SS1), service level.

    .venv/bin/python bench/rca_sockshop.py [--data PATH] [--json] [--ablations]

The data is the "Sock Shop 1" dataset of Ikram et al., "Root Cause Analysis of
Failures in Microservices through Causal Discovery" (NeurIPS 2022, azamikram/rcd),
reused as SS1 by Pham et al., "Root Cause Analysis for Microservices based on
Causal Inference: How Far Are We?" (ASE 2024, RCAEval). 50 cases, CPU-hog and
memory-leak faults in 5 services. The archive is unpacked into a temporary folder
and deleted afterwards.

Like RCAEval's runner for this dataset, `*_lat_50` and `*_lat_99` columns are
dropped before ranking (`--all-columns` keeps them). A service's rank is the rank
of its best-ranked metric, and, as in RCAEval's evaluation, a `<svc>-db` metric
counts for `<svc>` (`--no-fold-db` keeps `carts-db` apart from `carts`). AC@k:
share of cases whose service is in the top k; Avg@5: mean of AC@1..AC@5. The
random row is the mean over --draws random orders of each case's non-constant
columns, from one numpy generator seeded with --seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from sits_trace.analyzers.baselines import (
    Accuracy,
    Ranking,
    SitsParams,
    candidate_columns,
    evaluate,
    mean_accuracy,
    rank_random,
    rank_table,
    service_rank,
)
from sits_trace.analyzers.tables import Case, iter_cases, unpack_archive

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
DEFAULT_ARCHIVE = DEFAULT_DATA / "rcaeval-sockshop1.tar.xz"
# RCAEval (ASE'24) Table 5, Sock Shop 1, service-level Avg@5: (CPU, MEM).
PUBLISHED_AVG5: dict[str, tuple[float, float]] = {
    "baro": (0.99, 0.99),
    "nsigma": (0.98, 0.99),
    "random": (0.36, 0.33),
}
DROPPED_SUFFIXES = ("_lat_50", "_lat_99")


def rcaeval_columns(case: Case) -> Case:
    """The case without the latency columns RCAEval's runner drops for Sock Shop."""
    keep = [c for c in case.normal.columns if not str(c).endswith(DROPPED_SUFFIXES)]
    return Case(case.name, case.service, case.fault, case.normal[keep], case.anomalous[keep])


def load_cases(data: Path, all_columns: bool = False) -> list[Case]:
    """Cases from an unpacked folder or a .tar.* archive (unpacked to a temp dir)."""
    if data.is_dir():
        cases = list(iter_cases(data))
    else:
        with tempfile.TemporaryDirectory(prefix="sits-rca-") as tmp:
            cases = list(iter_cases(unpack_archive(data, Path(tmp))))
    if not cases:
        raise ValueError(f"{data}: no <service>-<fault>/<n>/normal.csv cases found")
    return cases if all_columns else [rcaeval_columns(c) for c in cases]


def _ranker(method: str, mem_mb: bool = True, signed: bool = True) -> Callable[[Case], Ranking]:
    def rank(c: Case) -> Ranking:
        return rank_table(c.normal, c.anomalous, method, mem_mb=mem_mb, signed=signed)

    return rank


def rankers(ablations: bool) -> dict[str, Callable[[Case], Ranking]]:
    """Each scored method as a function from a case to its ranking."""
    out = {m: _ranker(m) for m in ("sits", "baro", "nsigma")}
    if ablations:
        out["baro (mem in bytes)"] = _ranker("baro", mem_mb=False)
        out["baro (|z|, unsigned)"] = _ranker("baro", signed=False)
        out["nsigma (|z|, unsigned)"] = _ranker("nsigma", signed=False)
    return out


def random_baseline(cases: list[Case], seed: int, draws: int, fold_db: bool) -> dict[str, Accuracy]:
    """Accuracy of random rankings, averaged over draws per case."""
    rng = np.random.default_rng(seed)
    columns = {c.name: candidate_columns(c.normal, c.anomalous) for c in cases}
    runs = [
        evaluate(cases, lambda c: rank_random(columns[c.name], rng), fold_db=fold_db)
        for _ in range(draws)
    ]
    return {fault: mean_accuracy([r[fault] for r in runs]) for fault in runs[0]}


def run(args: argparse.Namespace, cases: list[Case]) -> dict[str, dict[str, Accuracy]]:
    """Service-level accuracy per method and fault type."""
    fold = not args.no_fold_db
    scored = {n: evaluate(cases, fn, fold_db=fold) for n, fn in rankers(args.ablations).items()}
    main_rows = {n: scored.pop(n) for n in ("sits", "baro", "nsigma")}
    chance = {"random": random_baseline(cases, args.seed, args.draws, fold)}
    return main_rows | chance | scored


SWEEP_FLOORS = (0.0, 0.003, 0.01, 0.03, 0.1)
SWEEP_QUANTILES = (0.5, 0.75, 0.9, 1.0)
SWEEP_DROP_WEIGHTS = (0.0, 0.5, 1.0)


def sweep(cases: list[Case], fold_db: bool) -> list[tuple[SitsParams, dict[str, Accuracy]]]:
    """Sits accuracy over a grid of its knobs: how much the default is tuned to this data."""
    out = []
    for floor, q, w in itertools.product(SWEEP_FLOORS, SWEEP_QUANTILES, SWEEP_DROP_WEIGHTS):
        params = SitsParams(level_floor=floor, quantile=q, drop_weight=w)

        def rank(c: Case, params: SitsParams = params) -> Ranking:
            return rank_table(c.normal, c.anomalous, "sits", sits=params)

        out.append((params, evaluate(cases, rank, fold_db=fold_db)))
    return out


def print_sweep(rows: list[tuple[SitsParams, dict[str, Accuracy]]]) -> None:
    print("sits knobs: level_floor quantile drop_weight -> Avg@5 cpu / mem")
    for p, acc in rows:
        print(
            f"{p.level_floor:>11} {p.quantile:>8} {p.drop_weight:>11}"
            f" -> {acc['cpu'].avg5:.2f} / {acc['mem'].avg5:.2f}"
        )


def print_misses(cases: list[Case], fold_db: bool) -> None:
    """Each case a method does not rank first: the true service's rank and the top metric."""
    for name, fn in rankers(ablations=False).items():
        for c in cases:
            ranking = fn(c)
            r = service_rank(ranking, c.service, fold_db=fold_db)
            if r != 1:
                top, score = ranking[0]
                print(f"{name:<8}{c.name:<18}rank {r}  top: {top} ({score:.1f})")


def _published(method: str, fault: str) -> float | None:
    pair = PUBLISHED_AVG5.get(method)
    if pair is None or fault not in ("cpu", "mem"):
        return None
    return pair[0] if fault == "cpu" else pair[1]


def print_table(results: dict[str, dict[str, Accuracy]], n_cases: int, seconds: float) -> None:
    print(f"Sock Shop 1 (RCAEval SS1), {n_cases} cases, service level, {seconds:.1f} s")
    print(f"{'method':<24}{'fault':<7}{'AC@1':>6}{'AC@3':>6}{'Avg@5':>7}{'published':>11}")
    for method, by_fault in results.items():
        for fault, acc in by_fault.items():
            pub = _published(method, fault)
            pub_s = f"{pub:.2f}" if pub is not None else "-"
            print(
                f"{method:<24}{fault:<7}{acc.at(1):>6.2f}{acc.at(3):>6.2f}"
                f"{acc.avg5:>7.2f}{pub_s:>11}"
            )


def as_json(results: dict[str, dict[str, Accuracy]], args: argparse.Namespace) -> str:
    doc = {
        "dataset": "sock-shop-1",
        "level": "service",
        "seed": args.seed,
        "fold_db": not args.no_fold_db,
        "random_draws": args.draws,
        "all_columns": args.all_columns,
        "results": {
            m: {
                f: {
                    "cases": a.cases,
                    "ac": [round(x, 4) for x in a.ac],
                    "avg5": round(a.avg5, 4),
                    "published_avg5": _published(m, f),
                }
                for f, a in by_fault.items()
            }
            for m, by_fault in results.items()
        },
    }
    return json.dumps(doc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: .venv/bin/python bench/rca_sockshop.py --ablations",
    )
    p.add_argument("--data", type=Path, default=DEFAULT_ARCHIVE, help="archive or unpacked folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the random ranking (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--all-columns", action="store_true", help="keep *_lat_50 and *_lat_99")
    p.add_argument("--draws", type=int, default=100, help="random rankings per case (default 100)")
    p.add_argument("--no-fold-db", action="store_true", help="rank <svc>-db apart from <svc>")
    p.add_argument("--ablations", action="store_true", help="add BARO/NSigma variants")
    p.add_argument("--sweep", action="store_true", help="sits over a grid of its knobs instead")
    p.add_argument("--misses", action="store_true", help="list the cases a method misses instead")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.draws < 1:
        print("error: --draws must be at least 1", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        cases = load_cases(args.data, args.all_columns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.misses:
        print_misses(cases, not args.no_fold_db)
        return 0
    if args.sweep:
        rows = sweep(cases, not args.no_fold_db)
        if args.json:
            print(
                json.dumps([{**vars(p), **{f: a.avg5 for f, a in acc.items()}} for p, acc in rows])
            )
        else:
            print_sweep(rows)
        return 0
    results = run(args, cases)
    if args.json:
        print(as_json(results, args))
    else:
        print_table(results, len(cases), time.monotonic() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
