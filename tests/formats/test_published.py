"""A published drafts root as both of its readers see it: version names, manifests, the
`current` pointer and where a version's draft lies (formats/published.py)."""

import json

import pytest

from specdistill.errors import UserError
from specdistill.formats.published import (
    CurrentUnreadableError,
    Manifest,
    OutsideRootError,
    read_current,
    read_manifest,
    version_draft_dir,
    version_name,
    version_number,
)


def test_a_version_name_and_its_number_round_trip():
    assert version_name(1) == "v000001"
    assert version_number(version_name(42)) == 42
    for other in ("v1", "v0000001", "current", "x000001", ".tmp-v000001"):
        assert version_number(other) is None


def test_current_names_a_version_or_nothing(tmp_path):
    assert read_current(tmp_path) is None  # no such file
    (tmp_path / "current").write_text("\n")
    assert read_current(tmp_path) is None  # empty
    (tmp_path / "current").write_text("v000003\n")
    assert read_current(tmp_path) == "v000003"


@pytest.mark.parametrize("kind", ["not utf-8", "a directory"])
def test_a_current_that_cannot_be_read_is_one_clear_error(tmp_path, kind):
    if kind == "a directory":
        (tmp_path / "current").mkdir()
    else:
        (tmp_path / "current").write_bytes(b"\xff\xfe")
    with pytest.raises(CurrentUnreadableError, match="cannot read the current version"):
        read_current(tmp_path)


def test_a_manifest_round_trips_and_ignores_fields_it_does_not_know(tmp_path):
    assert read_manifest(tmp_path) == Manifest()  # none written
    manifest = Manifest(version="v000002", parent="v000001", reason="promoted", ci=[0.1, 0.2])
    manifest.write(tmp_path)
    assert read_manifest(tmp_path) == manifest
    fields = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**fields, "from_a_newer_job": 1}))
    assert read_manifest(tmp_path) == manifest


def test_a_versions_draft_lies_inside_the_root_or_is_refused(tmp_path):
    root = tmp_path / "root"
    (root / "v000001" / "head").mkdir(parents=True)
    assert version_draft_dir(root, "v000001") == (root / "v000001").resolve()
    Manifest(draft_dir="head").write(root / "v000001")
    assert version_draft_dir(root, "v000001") == (root / "v000001" / "head").resolve()
    Manifest(draft_dir="../../elsewhere").write(root / "v000001")
    with pytest.raises(OutsideRootError, match="outside the drafts root"):
        version_draft_dir(root, "v000001")
    (tmp_path / "elsewhere").mkdir()
    (root / "v000002").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OutsideRootError, match="v000002 resolves to"):
        version_draft_dir(root, "v000002")
    with pytest.raises(UserError, match="is not a version like v000001"):
        version_draft_dir(root, "../v000001")
