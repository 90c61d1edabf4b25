"""UnQover's reader at the size of the generator's ethnicity file: time and peak memory of the
project's bounded reader (:func:`fairprune.data.unqover.write_docs`: check, then the documents in the
stratified order) against ``json.load`` of the same file, each in its own process
(``bench/peak_rss.py``), side by side in one run.

The file is the generator's layout at its size: the bundled stand-in's ethnicity class with more
subjects and attributes, 147,000-odd examples (the generator's ethnicity file: 147,000, 139 MB).

    python bench/unqover_reader.py          # writes bench/results/unqover_reader.{json,md}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def write_big(path: Path, subjects: int, attributes: int, templates: int) -> int:
    """An ethnicity-class file in the generator's layout, written one example at a time."""
    names = [f"Group{i:03d}" for i in range(subjects)]
    count = 0
    with path.open("w", encoding="utf-8") as out:
        out.write("{")
        for s1 in names:
            for s2 in names:
                if s1 == s2:
                    continue
                for tid in range(templates):
                    for a in range(attributes):
                        act = f"attribute{a}"
                        key = f"{s1.lower()}|{s2.lower()}|{s1}|{s2}|{tid}|biased_ethnicity|{act}|{act}"
                        value = {"context": f"A {s1} man got off the flight {tid} to visit a {s2} man.",
                                 **{f"q{i}": {"question": f"Who had a reputation of being {'not ' * i}{act}?", "pred": "",
                                              "ans0": {"text": s1, "start": "", "end": ""},
                                              "ans1": {"text": s2, "start": "", "end": ""}} for i in (0, 1)}}
                        out.write(("," if count else "") + "\n    " + json.dumps(key) + ": "
                                  + json.dumps(value, indent=4).replace("\n", "\n    "))
                        count += 1
        out.write("\n}")
    return count


def measured(code: str) -> tuple[float, float]:
    """Seconds and peak resident GiB of ``code`` run in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(HERE / "peak_rss.py"), "-c", code], capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    peak = int(done.stdout.strip().splitlines()[-1].split()[1])
    return seconds, peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=70)
    parser.add_argument("--attributes", type=int, default=10)
    parser.add_argument("--templates", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slotmap_ethnicity_biasedethnicity_ethnicitynoact.source.json"
        examples = write_big(path, args.subjects, args.attributes, args.templates)
        size = path.stat().st_size / 2**20
        baseline = measured("import json, torch, transformers\n"  # the same imports as the reader's process
                            f"json.load(open({str(path)!r}))")
        reader = measured("import torch, transformers, os\n"
                          f"os.environ['FAIRPRUNE_CACHE'] = {tmp!r}\n"
                          "from fairprune.data.unqover import check_source, write_docs\n"
                          f"check_source({str(path)!r}); write_docs({str(path)!r}, 0)")
        imports = measured("import torch, transformers")
    rows = [{"what": "json.load", "seconds": baseline[0], "peak_gib": baseline[1]},
            {"what": "fairprune: check + stratified documents", "seconds": reader[0], "peak_gib": reader[1]},
            {"what": "the imports alone", "seconds": imports[0], "peak_gib": imports[1]}]
    RESULTS.mkdir(exist_ok=True)
    facts = {"examples": examples, "file_mib": size, "rows": rows}
    (RESULTS / "unqover_reader.json").write_text(json.dumps(facts, indent=2) + "\n")
    lines = [f"{examples:,} examples, {size:.0f} MiB (the generator's layout); each in a fresh process with torch and "
             "transformers imported, side by side in one run.", "",
             "| what | seconds | peak resident GiB | above the imports |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['seconds']:.1f} | {r['peak_gib']:.2f} | {r['peak_gib'] - imports[1]:+.2f} |" for r in rows]
    (RESULTS / "unqover_reader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
