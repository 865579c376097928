"""The online job's settings and directories at their edges: out-of-range settings are recipe
errors naming the key, an output or drafts path that is a file and an unreadable `current`
are one-line errors (exit 2), before anything is read or written."""

import json

import pytest

from specdistill.errors import run_guarded


def online(argv, capsys):
    from specdistill.train.online.job import main

    rc = run_guarded(main, argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_line_bytes", -1),
        ("max_line_bytes", 0),
        ("max_refreshes", -3),
        ("dedup_size", -1),
        ("bootstrap_samples", 1_000_000_000),
        ("max_record_tokens", 0),
        ("refresh_seconds", -1),
        ("min_category_samples", 0),
    ],
)
def test_a_setting_out_of_range_is_a_recipe_error_naming_it(key, value, tmp_path, capsys):
    argv = ["--once", f"online.traffic={tmp_path}", f"online.{key}={json.dumps(value)}"]
    rc, err = online(argv, capsys)
    assert rc == 2 and err.startswith("recipe error: ") and f"online.{key}" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("key", ["output_dir", "drafts"])
@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_an_output_or_drafts_path_that_is_a_file_is_refused(key, where, tmp_path, capsys):
    (tmp_path / "traffic").mkdir()
    taken = tmp_path / "taken"
    taken.write_text("keep me\n")
    path = taken if where == "file" else taken / "sub"
    argv = [
        "--once",
        f"online.traffic={tmp_path / 'traffic'}",
        f"online.output_dir={tmp_path / 'out'}",
        f"online.drafts={tmp_path / 'drafts'}",
        f"online.{key}={path}",
    ]
    rc, err = online(argv, capsys)
    assert rc == 2 and err.startswith(f"error: online.{key} {path}") and "not a directory" in err
    assert taken.read_text() == "keep me\n"


@pytest.mark.parametrize("how", ["not_utf8", "directory"])
def test_rollback_with_an_unreadable_current_is_one_line(how, tmp_path, capsys):
    root = tmp_path / "drafts"
    root.mkdir()
    if how == "not_utf8":
        (root / "current").write_bytes(b"v0000\xff\xfe\n")
    else:
        (root / "current").mkdir()
    rc, err = online(["rollback", "--drafts", str(root)], capsys)
    assert rc == 2 and "cannot read the current version" in err and str(root / "current") in err
    assert len(err.strip().splitlines()) == 1
