"""tests/heavy.py: every test it names exists, and the marking picks exactly those."""

from tests.heavy import HEAVY, check, is_heavy


def test_every_heavy_test_exists():
    assert check(HEAVY) == []


def test_a_name_that_is_gone_is_reported(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_here():\n    pass\n")
    names = {"tests/test_x.py::test_here", "tests/test_x.py::test_gone", "tests/nope.py::test_a"}
    assert check(names, tmp_path) == ["tests/nope.py::test_a", "tests/test_x.py::test_gone"]


def test_a_function_name_marks_every_parametrisation_and_a_param_only_itself():
    names = {"tests/a.py::test_f", "tests/a.py::test_g[export]"}
    assert is_heavy("tests/a.py::test_f", names)
    assert is_heavy("tests/a.py::test_f[1-2]", names)
    assert is_heavy("tests/a.py::test_g[export]", names)
    assert not is_heavy("tests/a.py::test_g[distill]", names)
    assert not is_heavy("tests/a.py::test_fg", names)
