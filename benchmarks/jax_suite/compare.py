"""Compare the baseline and swapped JUnit XML files: passed-in-baseline tests that fail with the swap.

Usage: python compare.py OUT_DIR FILE [FILE...] [--categories CATS.json]
(FILE without .py; reads OUT_DIR/{base,swap}_FILE.xml and OUT_DIR/calls_swap_FILE.json)

The denominator: tests that pass in the base run AND built at least one chunked vmap in the swap
run (``CHUNKOP_CALLS``; every other test runs identical code in both runs). The raw numbers (all
collected / all base-passing tests) are printed too.

``--categories`` (e.g. ``categories.json`` beside this file) maps a test id
(``module.Class::name``, as printed in the LOST lines) to ``{"cat": "a"|"b"|"c", "cause": ..., "note": ...}``:
(a) chunkop's own clear error for something it deliberately refuses, (b) the test asserts JAX's
wording or jaxpr structure that chunkop changes without being wrong, (c) a chunkop gap. The
adjusted ratio is (swap passed + a + b) / denominator. Lost tests missing from the file are
counted as ``?`` (uncategorised) and listed.

Writes OUT_DIR/lost.json: per file, every lost test with the last ``E`` line of its error, its
category and whether it built a chunked vmap.
"""

import json
import os
import re
import sys
import xml.etree.ElementTree as ET


def _last_error_line(bad):
    """The last ``E   ...`` line of pytest's report in the failure text, else the message."""
    text = bad.text or ""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    lines = [ln for ln in lines if ln]
    # (a multi-line message's last line is a fragment: the last line naming the exception instead)
    named = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit|Transformation)\b:?", ln)]
    if named or lines:
        return (named or lines)[-1][:300]
    msg = (bad.get("message") or "").strip().splitlines()
    return msg[-1][:300] if msg else ""


def outcomes(path):
    res = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            res[name] = ("failed", _last_error_line(bad))
        elif tc.find("skipped") is not None:
            res[name] = ("skipped", "")
        else:
            res[name] = ("passed", "")
    return res


def _junit_id(nodeid):
    """A pytest node id as the JUnit file names it (``module.Class::name``): pytest's own mangling
    (which, in pytest 9, re-brackets a test name holding ``[``), else a plain fallback."""
    try:
        from _pytest.junitxml import mangle_test_address

        names = mangle_test_address(nodeid)
    except Exception:  # noqa: BLE001 - another pytest: the plain form
        names = nodeid.split("::")
        names[0] = names[0][:-3].replace("/", ".") if names[0].endswith(".py") else names[0]
    return f"{'.'.join(names[:-1])}::{names[-1]}"


def chunked_calls(path):
    """Test id (``module.Class::name``) -> how many chunked vmaps it built (from a pytest node id)."""
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        raw = json.load(fh)
    return {_junit_id(nodeid): k for nodeid, k in raw.items()}


def main(out, files, cats):
    rows, lost_all = [], {}
    tot = dict(n=0, base=0, built=0, swap_ok=0, raw_ok=0, a=0, b=0, c=0, unk=0, other=0)
    for f in files:
        base, swap = outcomes(f"{out}/base_{f}.xml"), outcomes(f"{out}/swap_{f}.xml")
        calls = chunked_calls(f"{out}/calls_swap_{f}.json")
        passed = [n for n, (o, _) in base.items() if o == "passed"]
        built = [n for n in passed if calls.get(n, 0) > 0]
        lost = [n for n in passed if swap.get(n, ("missing", ""))[0] != "passed"]
        raw_ok = len(passed) - len(lost)
        lost_built = [n for n in lost if calls.get(n, 0) > 0]
        lost_other = [n for n in lost if calls.get(n, 0) == 0]  # identical code in both runs: noise
        swap_ok = len(built) - len(lost_built)
        count = {"a": 0, "b": 0, "c": 0, "?": 0}
        for n in lost_built:
            count[cats.get(n, {}).get("cat", "?")] += 1
        adj = swap_ok + count["a"] + count["b"]
        rows.append((f, len(base), len(passed), len(built), swap_ok, count, adj, raw_ok, len(lost_other)))
        for k, v in (
            ("n", len(base)),
            ("base", len(passed)),
            ("built", len(built)),
            ("swap_ok", swap_ok),
            ("raw_ok", raw_ok),
            ("a", count["a"]),
            ("b", count["b"]),
            ("c", count["c"]),
            ("unk", count["?"]),
            ("other", len(lost_other)),
        ):
            tot[k] += v
        lost_all[f] = {
            n: {
                "error": swap.get(n, ("missing", "not run in the swap run"))[1],
                "cat": cats.get(n, {}).get("cat", "?"),
                "cause": cats.get(n, {}).get("cause", ""),
                "chunked_calls": calls.get(n, 0),
            }
            for n in lost
        }
    pct = lambda x, y: f"{100.0 * x / max(y, 1):.1f}%"
    print(
        "| file | collected | base passed | swap built chunked (denominator) | swap passed | (a) | (b) | (c) "
        "| adjusted (passed+a+b) | adjusted ratio | raw: swap passed / base passed |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for f, n, p, b, ok, c, adj, raw_ok, _other in rows:
        unk = f" (+{c['?']} uncategorised)" if c["?"] else ""
        print(
            f"| {f} | {n} | {p} | {b} | {ok} | {c['a']} | {c['b']} | {c['c']}{unk} | {adj} | {pct(adj, b)} "
            f"| {raw_ok} / {p} = {pct(raw_ok, p)} |"
        )
    adj = tot["swap_ok"] + tot["a"] + tot["b"]
    unk = f" (+{tot['unk']} uncategorised)" if tot["unk"] else ""
    print(
        f"| **all** | {tot['n']} | {tot['base']} | {tot['built']} | {tot['swap_ok']} | {tot['a']} | {tot['b']} "
        f"| {tot['c']}{unk} | {adj} | **{pct(adj, tot['built'])}** | {tot['raw_ok']} / {tot['base']} = "
        f"{pct(tot['raw_ok'], tot['base'])} |"
    )
    if tot["other"]:
        print(
            f"\n{tot['other']} base-passing tests failed in the swap run without building a chunked vmap "
            "(not in the denominator; see lost.json, chunked_calls 0)"
        )
    with open(f"{out}/lost.json", "w") as fh:
        json.dump(lost_all, fh, indent=1)
    for d in lost_all.values():
        for n, r in d.items():
            print(f"LOST [{r['cat']}] calls={r['chunked_calls']} {n} :: {r['error']}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    cats = {}
    if "--categories" in argv:
        i = argv.index("--categories")
        with open(argv[i + 1]) as fh:
            cats = json.load(fh)
        argv = argv[:i] + argv[i + 2 :]
    main(argv[0], argv[1:], cats)
