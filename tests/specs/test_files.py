"""specs/files.py: YAML/JSON read strictly but as meant, output paths tried without being touched, atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specs.errors import AutoparError
from specs.files import _umask, check_output_dir, check_output_file, read_mapping, write_text_atomic


def test_yaml_reads_exponents_as_numbers_and_merges_keys(tmp_path):
    """YAML 1.1 reads 1e-5 (no dot) as text; a spec writing it means a number. A merge (<<: *anchor) may be
    overridden; a key written twice may not."""
    f = tmp_path / "m.yaml"
    f.write_text("norm_eps: 1e-5\nrope_theta: 5e5\nname: '1e5'\nbase: &b {x: 1, y: 2}\nm:\n  <<: *b\n  x: 3\n")
    data = read_mapping(f, "spec")
    assert data["norm_eps"] == 1e-5 and data["rope_theta"] == 5e5 and data["name"] == "1e5"
    assert data["m"] == {"x": 3, "y": 2}
    f.write_text("a: 1\nb: 2\na: 3\n")
    with pytest.raises(AutoparError, match="gives 'a' twice"):
        read_mapping(f, "spec")
    f.write_text("? [a, b]\n: 1\n")
    with pytest.raises(AutoparError, match="is not valid YAML"):
        read_mapping(f, "spec")


@pytest.mark.parametrize("text,said", [
    ("null", 'must hold a JSON object of fields (`{"key": value, ...}`), not null'),
    ("", 'is empty; write a JSON object of fields (`{"key": value, ...}`)'),
    (" \n \n", 'is empty; write a JSON object of fields (`{"key": value, ...}`)'),
    ("[1, 2]", 'must hold a JSON object of fields (`{"key": value, ...}`), not a list'),
])
def test_a_json_file_of_no_object_is_said_in_json_terms(tmp_path, text, said):
    """A .json file is told of a JSON object, not of YAML's `key: value` lines; one of nothing is empty, not invalid
    JSON; YAML files keep their own words."""
    f = tmp_path / "m.json"
    f.write_text(text)
    with pytest.raises(AutoparError) as err:
        read_mapping(f, "spec")
    assert str(err.value) == f"spec {f} {said}"
    f = tmp_path / "m.yaml"
    f.write_text(text.replace("[1, 2]", "- 1\n- 2\n"))
    with pytest.raises(AutoparError, match=r"is empty; write its fields \(`key: value` lines\)|must hold a mapping of "
                                           r"fields \(`key: value` lines\), not a list"):
        read_mapping(f, "spec")


@pytest.mark.parametrize("name", ["m.json", "m.yaml"])
def test_a_byte_order_mark_is_skipped_in_json_as_in_yaml(tmp_path, name):
    """Some editors start a UTF-8 file with a byte-order mark: YAML reads past it, and so does JSON here."""
    f = tmp_path / name
    f.write_bytes(b"\xef\xbb\xbf" + b'{"a": 1}')
    assert read_mapping(f, "spec") == {"a": 1}


def test_output_checks_never_touch_the_target(tmp_path):
    """The probe makes and removes a uniquely named folder beside the target: a broken link, or a file that
    appears meanwhile, is left as it is, and nothing stays behind."""
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "missing-target.json")
    check_output_file(link, "plan file")
    check_output_file(tmp_path / "new" / "deeper" / "p.json", "plan file")
    check_output_dir(tmp_path / "trials", "trial folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"] and link.is_symlink()


def test_atomic_write_goes_through_links_and_keeps_the_mode(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "p.json"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new" and target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "real.json"]
    write_text_atomic(tmp_path / "fresh.json", "x")
    assert (tmp_path / "fresh.json").stat().st_mode & 0o777 == 0o666 & ~_umask()


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
def test_atomic_write_to_a_device_writes_it_directly():
    write_text_atomic("/dev/null", "x")  # no temporary file can be made in /dev's place of a regular file

