"""Compare the baseline and swapped JUnit XML files: passed-in-baseline tests that fail with the swap.

Usage: python compare.py OUT_DIR FILE [FILE...]  (FILE without .py; reads OUT_DIR/{base,swap}_FILE.xml)
"""

import json
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    res = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            res[name] = ("failed", (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else "")
        elif tc.find("skipped") is not None:
            res[name] = ("skipped", "")
        else:
            res[name] = ("passed", "")
    return res


def main(out, files):
    tot_base = tot_swap = 0
    rows, failures = [], {}
    for f in files:
        base, swap = outcomes(f"{out}/base_{f}.xml"), outcomes(f"{out}/swap_{f}.xml")
        passed = [n for n, (o, _) in base.items() if o == "passed"]
        lost = [n for n in passed if swap.get(n, ("missing", ""))[0] != "passed"]
        ok = len(passed) - len(lost)
        tot_base, tot_swap = tot_base + len(passed), tot_swap + ok
        rows.append((f, len(base), len(passed), ok, 100.0 * ok / max(len(passed), 1)))
        failures[f] = {n: swap.get(n, ("missing", ""))[1] for n in lost}
    print("| file | collected | passed (jax.vmap) | passed (chunkop.vmap) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for f, n, p, ok, r in rows:
        print(f"| {f} | {n} | {p} | {ok} | {r:.1f}% |")
    print(f"| **all** | | {tot_base} | {tot_swap} | {100.0 * tot_swap / max(tot_base, 1):.1f}% |")
    with open(f"{out}/lost.json", "w") as fh:
        json.dump(failures, fh, indent=1)
    for f, d in failures.items():
        for n, msg in d.items():
            print(f"LOST {f} {n} :: {msg}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
