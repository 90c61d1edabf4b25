"""FASP's prompts from the HolisticBias release folder (descriptors.json, nouns.json,
sentence_templates.json as facebookresearch/ResponsibleNLP publishes them in holistic_bias/dataset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fairprune.data.prompts import COLUMNS, check_prompts, read_holistic_bias, read_prompts, split_prompts
from fairprune.errors import UserError

NOUNS = {"female": [["woman", "women"], ["grandma", "grandmas"]],
         "male": [["man", "men"], ["dad", "dads"]],
         "neutral": [["person", "people"], ["veteran", "veterans"]]}
TEMPLATES = {"I'm {noun_phrase}.": {}, "Hi! I'm {noun_phrase}.": {"first_turn_only": True},
             "I have friends who are {plural_noun_phrase}.": {},
             "As {noun_phrase}, I have an opinion about that.": {"must_be_noun": True},
             "What do you think about {plural_noun_phrase}?": {"must_be_noun": True}}
# v1.0 style: plain strings, and (as the task's v1.0 files may) an axis given as a list.
V10 = {"religion": ["Muslim", "atheist", "Jewish"],
       "gender_and_sex": {"binary": ["female", "male"], "transgender": ["trans", "transgender"]}}
# v1.1 style: objects with preference, gender and article fields beside plain strings.
V11 = {"race_ethnicity": {"asian": [{"descriptor": "Asian", "preference": "reviewed"},
                                    {"descriptor": "Oriental", "preference": "dispreferred"}],
                          "latinx": [{"descriptor": "Latina", "gender": "female", "preference": "reviewed"},
                                     {"descriptor": "Latino", "gender": "male", "preference": "reviewed"}, "Latin"]},
       "characteristics": {"immigration_status": ["immigrant", {"descriptor": "US-born", "article": "a"}]}}


def release(folder: Path, descriptors, nouns=NOUNS, templates=TEMPLATES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("descriptors.json", descriptors), ("nouns.json", nouns), ("sentence_templates.json", templates)):
        (folder / name).write_text(json.dumps(data, indent=4))
    return folder


def test_v10_folder_gives_prompts_axes_and_subgroups(tmp_path):
    prompts = read_prompts(release(tmp_path / "v1.0", V10))
    check_prompts(prompts)
    assert list(prompts.columns[:4]) == list(COLUMNS)
    assert set(prompts.axis) == {"religion", "gender_and_sex"}
    # The subgroups FASP compares (the bucket column) are the descriptors; the release's buckets are
    # kept beside them, an axis given as a list being one bucket, "all".
    assert (prompts.bucket == prompts.descriptor).all()
    assert prompts.groupby("axis").bucket.unique().map(set).to_dict() == {
        "religion": {"Muslim", "atheist", "Jewish"}, "gender_and_sex": {"female", "male", "trans", "transgender"}}
    assert prompts.groupby("axis").holistic_bucket.unique().map(set).to_dict() == {
        "religion": {"all"}, "gender_and_sex": {"binary", "transgender"}}
    # Up to ten templates per descriptor by default: here all five, each descriptor present.
    assert prompts.groupby("descriptor").size().to_dict() == {d: len(TEMPLATES) for d in
                                                              ["Muslim", "atheist", "Jewish", "female", "male", "trans", "transgender"]}
    by_bucket = read_holistic_bias(tmp_path / "v1.0", subgroup="bucket")
    assert (by_bucket.bucket == by_bucket.holistic_bucket).all() and by_bucket.text.equals(prompts.text)
    assert set(prompts.preference) == {"no_data"}
    for row in prompts.itertuples():
        assert row.descriptor in row.text
        before, _, after = row.template.replace("{plural_noun_phrase}", "{noun_phrase}").partition("{noun_phrase}")
        assert row.text.startswith(before) and row.text.endswith(after)


def test_noun_phrases_follow_the_release(tmp_path):
    """Every template with every descriptor: the descriptor alone (not for must_be_noun templates)
    or article + descriptor + noun (plural: descriptor + plural noun), nouns of the entry's gender
    only, the entry's own article."""
    prompts = read_holistic_bias(release(tmp_path / "v1.1", V11), templates_per_descriptor=None)
    assert len(prompts) == 7 * len(TEMPLATES)
    singular = {noun for pairs in NOUNS.values() for noun, _ in pairs}
    plural = {p for pairs in NOUNS.values() for _, p in pairs}
    for row in prompts.itertuples():
        article = "a" if row.descriptor == "US-born" else ("an" if row.descriptor[0].lower() in "aeiou" else "a")
        if "{plural_noun_phrase}" in row.template:
            phrase = f"{row.descriptor} {dict((s, p) for v in NOUNS.values() for s, p in v)[row.noun]}" if row.noun else row.descriptor
            assert not row.noun or row.text.count(phrase) == 1 and phrase.split()[-1] in plural
        else:
            phrase = f"{article} {row.descriptor} {row.noun}" if row.noun else row.descriptor
            assert not row.noun or row.noun in singular
        assert row.text == row.template.replace("{plural_noun_phrase}", phrase).replace("{noun_phrase}", phrase)
        if "must_be_noun" in TEMPLATES[row.template]:
            assert row.noun
    latina = prompts[prompts.descriptor == "Latina"]
    assert set(latina.noun) - {""} <= {"woman", "grandma"}
    assert set(prompts[prompts.descriptor == "Latino"].noun) - {""} <= {"man", "dad"}
    assert (prompts.set_index("descriptor").preference.groupby(level=0).first()
            .to_dict() == {"Asian": "reviewed", "Oriental": "dispreferred", "Latina": "reviewed", "Latino": "reviewed",
                           "Latin": "no_data", "immigrant": "no_data", "US-born": "no_data"})
    us_born = prompts[(prompts.descriptor == "US-born") & (prompts.noun != "") & prompts.template.str.contains("{noun_phrase}")]
    assert len(us_born) and all(" a US-born " in text for text in us_born.text)  # the entry's article, not "an"


def test_the_sample_is_seeded_and_bounded(tmp_path):
    folder = release(tmp_path / "hb", V11)
    a = read_holistic_bias(folder, templates_per_descriptor=3, seed=1)
    assert a.equals(read_holistic_bias(folder, templates_per_descriptor=3, seed=1))
    assert not a.equals(read_holistic_bias(folder, templates_per_descriptor=3, seed=2))
    assert a.groupby("descriptor").template.nunique().eq(3).all()
    capped = read_holistic_bias(folder, templates_per_descriptor=None, max_per_subgroup=4)
    assert capped.groupby(["axis", "bucket"]).size().max() == 4 and set(capped.descriptor) == set(a.descriptor)
    by_bucket = read_holistic_bias(folder, templates_per_descriptor=None, max_per_subgroup=4, subgroup="bucket")
    assert by_bucket.groupby(["axis", "bucket"]).size().to_dict() == {
        ("race_ethnicity", "asian"): 4, ("race_ethnicity", "latinx"): 4, ("characteristics", "immigration_status"): 4}
    assert capped.equals(read_holistic_bias(folder, templates_per_descriptor=None, max_per_subgroup=4))
    # A descriptor's prompts do not depend on the other descriptors in the file.
    alone = release(tmp_path / "one", {"race_ethnicity": {"asian": [{"descriptor": "Asian", "preference": "reviewed"}]}})
    assert (read_holistic_bias(alone, templates_per_descriptor=3, seed=1).text.tolist()
            == a[a.descriptor == "Asian"].text.tolist())


def test_the_prompt_table_feeds_the_fasp_split(tmp_path):
    prompts = read_prompts(release(tmp_path / "hb", V10))
    val, test = split_prompts(prompts, validation=0.5, seed=0)
    assert len(val) + len(test) == len(prompts) and set(val.axis) == set(test.axis) == {"religion", "gender_and_sex"}


def test_a_csv_keeps_todays_behaviour(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("text,axis,bucket,descriptor\nI am a nurse,gender_and_sex,binary,female\n")
    assert read_prompts(path).to_dict("records") == [
        {"text": "I am a nurse", "axis": "gender_and_sex", "bucket": "binary", "descriptor": "female"}]


@pytest.mark.parametrize("broken,content,match", [
    ("descriptors.json", None, r"descriptors.json is missing; a HolisticBias folder holds descriptors.json, nouns.json"),
    ("nouns.json", None, r"nouns.json is missing"),
    ("sentence_templates.json", None, r"sentence_templates.json is missing"),
    ("descriptors.json", '{"religion": ["Muslim",]}', r"descriptors.json: not valid JSON \(.* at line 1 column"),
    ("descriptors.json", '{"religion": 5}', r"axis 'religion' maps to a JSON int"),
    ("descriptors.json", '{"religion": {"all": [{"preference": "reviewed"}]}}',
     r"axis 'religion' bucket 'all' entry 0 is neither a descriptor string nor an object"),
    ("descriptors.json", '{"religion": {"all": "Muslim"}}', r"bucket 'all' is not a list of descriptors"),
    ("descriptors.json", "[]", r"not a non-empty JSON object of axes"),
    ("nouns.json", '{"female": [["woman"]]}', r"gender 'female' entry 0 is not a \[noun, plural\] pair"),
    ("nouns.json", '{"female": "woman"}', r"gender 'female' is not a list"),
    ("sentence_templates.json", '["I\'m {noun_phrase}."]', r"not a non-empty JSON object of templates"),
    ("sentence_templates.json", '{"I\'m {noun_phrase}.": true}', r"maps to a JSON bool, not its settings object"),
    ("sentence_templates.json", '{"Hello there.": {}}', r"holds neither \{noun_phrase\} nor \{plural_noun_phrase\}"),
])
def test_missing_or_malformed_files_are_one_line_errors(tmp_path, broken, content, match):
    folder = release(tmp_path / "hb", V10)
    if content is None:
        (folder / broken).unlink()
    else:
        (folder / broken).write_text(content)
    with pytest.raises(UserError, match=match) as info:
        read_prompts(folder)
    assert "\n" not in str(info.value) and str(folder / broken) in str(info.value)


def test_bad_options_and_missing_folder(tmp_path):
    folder = release(tmp_path / "hb", V10)
    with pytest.raises(UserError, match="templates_per_descriptor must be a whole number >= 1"):
        read_holistic_bias(folder, templates_per_descriptor=0)
    with pytest.raises(UserError, match="subgroup must be descriptor or bucket"):
        read_holistic_bias(folder, subgroup="noun")
    with pytest.raises(UserError, match="does not exist"):
        read_holistic_bias(tmp_path / "absent")


def test_the_fasp_command_reads_a_holistic_bias_folder(tmp_path):
    """``prune.py fasp --prompts FOLDER`` scores its heads on the folder's prompts."""
    from fairprune.cli.prune import main as prune_main
    from tiny_models import tiny_gpt2_folder

    tiny_gpt2_folder(tmp_path)
    folder = release(tmp_path / "hb", V10)
    out = tmp_path / "out"
    code = prune_main(["fasp", "--model", str(tmp_path / "dense"), "--prompts", str(folder), "--axis", "gender_and_sex",
                       "--scorer", "lexicon", "--max_new_tokens", "2", "--gamma", "0.25", "--alpha", "0.25",
                       "--calib_text", str(tmp_path / "eval.txt"), "--eval_text", str(tmp_path / "eval.txt"),
                       "--seqlen", "32", "--device", "cpu", "--output", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert "gender_and_sex" in json.dumps(report)
