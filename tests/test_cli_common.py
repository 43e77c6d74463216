"""The helpers every `flagos` subcommand shares (flagos/tools/_common.py): JSON written to a
file as to stdout, argument types that refuse what they say they refuse, sizes and shares in
words, aligned tables; checked against hand-written answers."""
import argparse
import json

import pytest

from flagos.tools import _common


def test_json_goes_to_a_file_exactly_as_to_stdout(tmp_path, capsys):
    data = {"chip": "cpu", "ops": [1, 2], "path": tmp_path}  # a Path: written as its text
    _common.write_json(data, "-")
    printed = capsys.readouterr().out
    _common.write_json(data, str(tmp_path / "out.json"))
    written = (tmp_path / "out.json").read_text()
    expected = json.dumps({"chip": "cpu", "ops": [1, 2], "path": str(tmp_path)}, indent=2) + "\n"
    assert printed == written == expected


@pytest.mark.parametrize("parse,text,value", [
    (_common.positive_int, "1", 1), (_common.positive_int, "12", 12),
    (_common.non_negative_int, "0", 0), (_common.non_negative_int, "3", 3)])
def test_counts_take_what_they_name(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize("parse,text,message", [
    (_common.positive_int, "0", "0 is not a positive integer"),
    (_common.positive_int, "-2", "-2 is not a positive integer"),
    (_common.non_negative_int, "-1", "-1 is negative")])
def test_counts_refuse_the_rest_in_words(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_sizes_shares_and_tables_in_words():
    assert [_common.format_bytes(n) for n in (None, 0, 1023, 1024, 1536, 5 * 2**20, 3 * 2**30)] == [
        "-", "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB"]
    assert _common.format_bytes(2**50) == "1024.0 TiB"  # the largest unit grows, never overflows
    assert [_common.format_share(x) for x in (None, 0.231, 1.0)] == ["-", "23.1%", "100.0%"]
    assert _common.format_table(["chip", "devices"], [["cpu", 1], ["sim", None]]).splitlines() == [
        "chip  devices", "----  -------", "cpu   1", "sim"]
