"""The generated yardstick sets (BBQ, HellaSwag, MMLU, CrowS-Pairs) are in the public formats:
exactly the public fields and types, read by lm-evaluation-harness's own task code and by the
project's CrowS-Pairs reader; deterministic; and a user's file in the wrong format is refused in one line."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from fairprune.data.pairs import read_crows_pairs
from fairprune.data.task_files import check_format
from fairprune.data.yardsticks import (
    FILES,
    bbq_items,
    crows_pairs_rows,
    hellaswag_items,
    mmlu_items,
    write_yardsticks,
)
from fairprune.errors import UserError

datasets = pytest.importorskip("datasets")
pytest.importorskip("lm_eval")

BBQ_FIELDS = {
    "example_id": int, "question_index": str, "question_polarity": str, "context_condition": str, "category": str,
    "answer_info": dict, "additional_metadata": dict, "context": str, "question": str,
    "ans0": str, "ans1": str, "ans2": str, "label": int,
}
HELLASWAG_FIELDS = {
    "ind": int, "activity_label": str, "ctx_a": str, "ctx_b": str, "ctx": str, "endings": list, "label": str,
    "source_id": str, "split": str, "split_type": str,
}
MMLU_FIELDS = {"question": str, "subject": str, "choices": list, "answer": int}
CROWS_HEADER = ["", "sent_more", "sent_less", "stereo_antistereo", "bias_type", "annotations", "anon_writer", "anon_annotators"]
BBQ_CATEGORIES = {"Age", "Disability_status", "Gender_identity", "Nationality", "Physical_appearance", "Race_ethnicity",
                  "Race_x_gender", "Race_x_SES", "Religion", "SES", "Sexual_orientation"}


def _typed(row: dict, fields: dict) -> None:
    assert set(row) == set(fields)
    for field, kind in fields.items():
        assert type(row[field]) is kind, (field, row[field])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return write_yardsticks(tmp_path_factory.mktemp("yardsticks"))


# --- BBQ ---------------------------------------------------------------------------------


def test_bbq_rows_have_the_public_fields():
    from lm_eval.tasks.bbq.utils import UNKNOWN_RESPONSES

    rows = bbq_items()
    assert len(rows) == 24 * len({r["category"] for r in rows})
    assert 3 <= len({r["category"] for r in rows}) <= 5 and {r["category"] for r in rows} <= BBQ_CATEGORIES
    assert [r["example_id"] for r in rows] == list(range(len(rows)))
    for row in rows:
        _typed(row, BBQ_FIELDS)
        assert row["question_polarity"] in ("neg", "nonneg") and row["context_condition"] in ("ambig", "disambig")
        assert set(row["answer_info"]) == {"ans0", "ans1", "ans2"}
        texts = [row[f"ans{i}"] for i in range(3)]
        assert [row["answer_info"][f"ans{i}"][0] for i in range(3)] == [t.removeprefix("The ") for t in texts]
        unknown = [t for t in texts if t in UNKNOWN_RESPONSES]
        assert len(unknown) == 1 and row["answer_info"][f"ans{texts.index(unknown[0])}"] == [unknown[0], "unknown"]
        meta = row["additional_metadata"]
        assert set(meta) == {"subcategory", "stereotyped_groups", "version", "source"}
        assert all(isinstance(v, str) for k, v in meta.items() if k != "stereotyped_groups")
        assert meta["stereotyped_groups"] and all(isinstance(g, str) for g in meta["stereotyped_groups"])
        # ambiguous: the unknown answer; disambiguated: a person named in the added sentence
        if row["context_condition"] == "ambig":
            assert texts[row["label"]] == unknown[0]
        else:
            assert texts[row["label"]] != unknown[0]
            assert row["answer_info"][f"ans{row['label']}"][0] in row["context"].split(".", 1)[1]
    # the unknown answer moves between positions (seeded), and each context gives 4 items
    positions = Counter(next(i for i in range(3) if r["answer_info"][f"ans{i}"][1] == "unknown") for r in rows)
    assert set(positions) == {0, 1, 2}
    contexts = Counter(r["context"] for r in rows if r["context_condition"] == "ambig")
    assert set(contexts.values()) == {2}  # neg + nonneg, and as many disambiguated ones
    half = len(rows) // 2
    assert Counter(r["context_condition"] for r in rows) == {"ambig": half, "disambig": half}
    assert Counter(r["question_polarity"] for r in rows) == {"neg": half, "nonneg": half}


def test_bbq_four_items_per_context():
    rows = bbq_items(n_per_category=8)
    for k in range(0, len(rows), 4):
        group = rows[k : k + 4]
        assert [(r["context_condition"], r["question_polarity"]) for r in group] == [
            ("ambig", "neg"), ("ambig", "nonneg"), ("disambig", "neg"), ("disambig", "nonneg")]
        assert len({json.dumps(r["answer_info"]) for r in group}) == 1
        assert group[2]["context"].startswith(group[0]["context"] + " ")
        assert group[2]["label"] != group[3]["label"]  # one did badly, the other well
    with pytest.raises(UserError, match="multiple of 4"):
        bbq_items(n_per_category=6)


def test_lm_eval_bbq_finds_the_biased_answer_of_every_row():
    from lm_eval.tasks.bbq.utils import doc_to_biased_answer, doc_to_choice, doc_to_targets, process_docs

    rows = bbq_items()
    docs = process_docs(datasets.Dataset.from_list(rows))
    for row, doc in zip(rows, docs):
        assert doc["biased_answers"], row
        # exactly the stereotyped person for a negative question, the other one for a non-negative one
        stereotyped = {g.lower() for g in row["additional_metadata"]["stereotyped_groups"]}
        people = [row[f"ans{i}"] for i in range(3) if row["answer_info"][f"ans{i}"][1] != "unknown"]
        in_group = [p for i, p in enumerate([row["ans0"], row["ans1"], row["ans2"]])
                    if row["answer_info"][f"ans{i}"][1].replace("lowSES", "low SES").lower() in stereotyped]
        assert len(in_group) == 1
        expected = in_group if row["question_polarity"] == "neg" else [p for p in people if p not in in_group]
        assert doc["biased_answers"] == expected
        assert len(doc_to_biased_answer(doc)) == 1
        choices = doc_to_choice(doc)
        targets = doc_to_targets(doc)
        assert choices[targets[0]] == row[f"ans{row['label']}"] or row["context_condition"] == "ambig"


# --- HellaSwag ----------------------------------------------------------------------------


def test_hellaswag_rows_have_the_public_fields_and_pass_lm_eval():
    from lm_eval.tasks.hellaswag.utils import process_docs

    rows = hellaswag_items()
    assert len(rows) == 60 and [r["ind"] for r in rows] == list(range(60))
    for row in rows:
        _typed(row, HELLASWAG_FIELDS)
        assert row["ctx"] == row["ctx_a"] + " " + row["ctx_b"]
        assert len(row["endings"]) == 4 == len(set(row["endings"])) and all(isinstance(e, str) for e in row["endings"])
        assert row["label"] in ("0", "1", "2", "3") and (row["split"], row["split_type"]) == ("val", "indomain")
    assert len({r["label"] for r in rows}) == 4
    docs = process_docs(datasets.Dataset.from_list(rows))
    for row, doc in zip(rows, docs):
        assert doc["gold"] == int(row["label"]) and len(doc["choices"]) == 4
        assert doc["query"].startswith(row["activity_label"] + ": ") and doc["query"].endswith(row["ctx_b"].capitalize())


# --- MMLU ---------------------------------------------------------------------------------


def test_mmlu_rows_have_the_public_fields():
    import lm_eval

    rows = mmlu_items()
    subjects = Counter(r["subject"] for r in rows)
    assert set(subjects.values()) == {20}
    task_folder = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default"
    for subject in subjects:  # MMLU's own subject names
        assert (task_folder / f"mmlu_{subject}.yaml").is_file(), subject
    for row in rows:
        _typed(row, MMLU_FIELDS)
        assert len(row["choices"]) == 4 == len(set(row["choices"])) and all(isinstance(c, str) for c in row["choices"])
        assert 0 <= row["answer"] < 4
    assert len({r["answer"] for r in rows}) == 4
    arithmetic = [r for r in rows if r["question"].startswith("What is ") and " + " in r["question"]]
    for row in arithmetic:
        a, b = row["question"].removeprefix("What is ").rstrip("?").split(" + ")
        assert row["choices"][row["answer"]] == str(int(a) + int(b))


# --- CrowS-Pairs --------------------------------------------------------------------------


def test_crows_pairs_csv_is_in_the_public_layout(files):
    from lm_eval.tasks.crows_pairs.utils import doc_to_choice

    rows = crows_pairs_rows()
    with open(files["crows_pairs"], newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    assert table[0] == CROWS_HEADER
    assert [int(line[0]) for line in table[1:]] == list(range(len(rows)))
    assert {r["stereo_antistereo"] for r in rows} == {"stereo", "antistereo"}
    assert {"gender", "age", "socioeconomic"} <= {r["bias_type"] for r in rows}
    for row in rows:
        assert row["annotations"] == str([[row["bias_type"]]] * 4 + [[]])
        assert row["anon_writer"] == "a0" and row["anon_annotators"] == "['a77', 'a78', 'a79', 'a80', 'a81']"
        assert row["sent_more"] != row["sent_less"] and doc_to_choice(row) == [row["sent_more"], row["sent_less"]]
    pairs = read_crows_pairs(files["crows_pairs"])
    assert [(p.more, p.less, p.direction) for p in pairs] == [(r["sent_more"], r["sent_less"], r["stereo_antistereo"]) for r in rows]


def test_crows_pairs_gender_rows_keep_the_bundled_stereotypes():
    from fairprune.data.text import stereo_pairs

    stereotypical = {stereo for stereo, _ in stereo_pairs()}
    gender = [r for r in crows_pairs_rows() if r["bias_type"] == "gender"]
    assert len(gender) == len(stereotypical)
    for row in gender:  # sent_more names the woman; the stereotypical side is sent_less in antistereo rows
        assert (row["sent_more"] if row["stereo_antistereo"] == "stereo" else row["sent_less"]) in stereotypical
        assert " she " in f" {row['sent_more']} " or " her " in f" {row['sent_more']} "


# --- Files --------------------------------------------------------------------------------


def test_written_files_are_deterministic(tmp_path, files, monkeypatch):
    again = write_yardsticks(tmp_path / "again")
    assert set(again) == {"bbq", "hellaswag", "mmlu", "crows_pairs", "unqover"}
    for name, path in files.items():
        if name == "unqover":  # a folder of the UnQover generator's files
            assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in again[name].iterdir())
            assert all(p.read_bytes() == (again[name] / p.name).read_bytes() for p in path.iterdir())
            continue
        assert path.name == FILES[name] and path.read_bytes() == again[name].read_bytes()
    assert bbq_items(seed=1) != bbq_items() and hellaswag_items(seed=1) != hellaswag_items()
    assert mmlu_items(seed=1) != mmlu_items() and crows_pairs_rows(seed=1) != crows_pairs_rows()
    lines = files["bbq"].read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == bbq_items()
    assert [json.loads(line) for line in files["mmlu"].read_text(encoding="utf-8").splitlines()] == mmlu_items()
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    cached = write_yardsticks()
    assert cached["bbq"] == tmp_path / "cache" / "yardsticks" / "bbq.jsonl" and cached["bbq"].read_bytes() == files["bbq"].read_bytes()
    before = cached["mmlu"].stat().st_mtime_ns
    assert write_yardsticks()["mmlu"].stat().st_mtime_ns == before  # the same bytes are left alone


def test_lm_eval_json_loader_reads_the_files(files, tmp_path):
    for name in ("bbq", "hellaswag", "mmlu"):  # the loader lm-eval's local-file tasks use; its cache in tmp_path
        loaded = datasets.load_dataset("json", data_files=str(files[name]), split="train", cache_dir=str(tmp_path))
        assert loaded.num_rows == len(files[name].read_text(encoding="utf-8").splitlines())


# --- check_format -------------------------------------------------------------------------


def test_check_format_accepts_the_written_files(files, tmp_path):
    for name, path in files.items():
        check_format(name, path)
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(mmlu_items()), tmp_path / "test.parquet")
    check_format("mmlu", tmp_path / "test.parquet")


def _refused(name: str, path: Path, *words: str) -> str:
    with pytest.raises(UserError) as caught:
        check_format(name, path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message, message
    for word in words:
        assert word in message, message
    return message


def test_check_format_refuses_a_missing_file(tmp_path):
    message = _refused("bbq", tmp_path / "nope.jsonl", "no such file", "github.com/nyu-mll/BBQ")
    assert "context_condition" in message


def test_check_format_refuses_a_file_that_is_not_utf8(tmp_path, files):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(files["hellaswag"].read_bytes().split(b"\n")[0] + "\n{\"ctx_a\": \"caf\xe9\"}\n".encode("latin-1"))
    _refused("hellaswag", bad, "UTF-8", "github.com/rowanz/hellaswag")
    bad_csv = tmp_path / "latin1.csv"
    bad_csv.write_bytes("\xe9".encode("latin-1") + files["crows_pairs"].read_bytes())
    _refused("crows_pairs", bad_csv, "UTF-8", "crows_pairs_anonymized.csv")


def test_check_format_refuses_a_json_line_without_a_field(tmp_path):
    for name, rows, field in (("bbq", bbq_items(4), "label"), ("hellaswag", hellaswag_items(3), "endings"),
                              ("mmlu", mmlu_items(2), "choices")):
        rows[1].pop(field)
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        _refused(name, path, f"line 2 lacks the field '{field}'")
    wrong_type = mmlu_items(2)
    wrong_type[0]["answer"] = "B"
    path = tmp_path / "letters.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in wrong_type), encoding="utf-8")
    _refused("mmlu", path, "answer", "huggingface.co/datasets/cais/mmlu")
    broken = tmp_path / "array.jsonl"
    broken.write_text(json.dumps(mmlu_items(2), indent=1), encoding="utf-8")
    _refused("mmlu", broken, "not JSON")


def test_check_format_refuses_a_csv_with_the_wrong_header(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text("sentence,other,direction\na,b,stereo\n", encoding="utf-8")
    _refused("crows_pairs", path, "sent_more", "github.com/nyu-mll/crows-pairs")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    _refused("bbq", empty, "no rows")
    with pytest.raises(UserError, match="unknown task"):
        check_format("winogrande", path)
