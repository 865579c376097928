"""specdistill/publish.py: used output directories are refused, one writer per directory."""

import subprocess
import sys

import pytest

from specdistill.publish import DirLock, OutputDirError, claim_output_dir, remove_leftovers


def test_claim_refuses_a_used_directory_and_names_its_files(tmp_path):
    (tmp_path / "report.md").write_text("earlier run")
    with pytest.raises(OutputDirError, match=r"report\.md.*--overwrite"):
        claim_output_dir(tmp_path, overwrite=False)
    assert (tmp_path / "report.md").read_text() == "earlier run"  # nothing lost
    assert claim_output_dir(tmp_path, overwrite=True) == tmp_path


def test_claim_creates_and_accepts_empty_or_hidden_only(tmp_path):
    out = claim_output_dir(tmp_path / "a" / "b", overwrite=False)
    assert out.is_dir()
    (out / ".lock").write_text("1")  # a lock file is not an output
    claim_output_dir(out, overwrite=False)
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError, match="is a file"):
        claim_output_dir(tmp_path / "f", overwrite=True)


def test_a_second_process_is_refused_while_the_lock_is_held(tmp_path):
    code = f"from specdistill.publish import DirLock; DirLock({str(tmp_path)!r}, 'job').acquire()"
    with DirLock(tmp_path, "online job"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode != 0 and "in use by job" in r.stderr
        with pytest.raises(OutputDirError, match="in use"):
            DirLock(tmp_path).acquire()  # one process, two holders: refused too
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # released


def test_remove_leftovers_keeps_real_outputs(tmp_path):
    for name in (".tmp-v000002", ".old-current-x1", ".state.json.tmp-ab"):
        (tmp_path / name).mkdir()
    (tmp_path / "v000001").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "v000001"]
