"""The spec is generated from the code: committed schemas and tables must match what the code makes."""

from __future__ import annotations

from stdengine import spec_gen
from stdengine.errors import all_error_classes
from stdengine.options import OPTION_NAMES


def test_committed_spec_matches_the_code():
    stale = [
        str(p)
        for p, content in spec_gen.render(spec_gen.default_spec_dir()).items()
        if not p.exists() or p.read_text(encoding="utf-8") != content
    ]
    assert not stale, f"run `python -m stdengine.spec_gen`; out of date: {stale}"


def test_every_option_is_in_the_options_table():
    table = (spec_gen.default_spec_dir() / "options.md").read_text()
    for name in OPTION_NAMES:
        assert f"| `{name}` |" in table


def test_error_codes_and_exit_statuses_are_unique_where_they_should_be():
    classes = all_error_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    # each top-level family has its own exit status
    top = [c for c in classes if c.__base__.__name__ == "InferError"]
    assert len({c.exit_status for c in top}) == len(top)
