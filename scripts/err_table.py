"""Per-test error table from a KDT_ERR_LOG file (see kdt.testing.rel_err).

    KDT_ERR_LOG=errs.tsv pytest -m gpu ...;  python scripts/err_table.py errs.tsv

One row per test: the number of checks, the largest reference shape and the largest relative error.
"""

import math
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows = defaultdict(list)
    with open(path) as f:
        for line in f:
            test, shape, err = line.rstrip("\n").split("\t")
            rows[test].append((shape, float(err)))
    print("| test | checks | largest shape | max rel. error |")
    print("|---|---:|---|---:|")
    for test, vals in rows.items():
        shape = max(vals, key=lambda v: math.prod(int(d) for d in v[0].split("x") if d))[0]
        print(f"| {test.split('::', 1)[-1]} ({test.split('::')[0].split('/')[-1]}) | {len(vals)} | {shape} | "
              f"{max(e for _, e in vals):.2e} |")


if __name__ == "__main__":
    main(sys.argv[1])
