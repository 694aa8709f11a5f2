"""docs/trace-format.md is generated from pdtrace/schema.py and must not drift from it."""

from pathlib import Path

from pdtrace import schema


def test_trace_format_doc_matches_schema():
    doc = (Path(__file__).parent.parent / "docs" / "trace-format.md").read_text()
    assert doc.strip() == schema.render_markdown().strip(), (
        "docs/trace-format.md is stale: run `python -m pdtrace.schema > docs/trace-format.md`")


def test_every_kind_is_documented_with_its_fields():
    doc = schema.render_markdown()
    for name, kind in schema.KINDS.items():
        assert f"### `{name}`" in doc
        for f in kind.fields:
            assert f"| `{f.name}` |" in doc


def test_validate_event():
    ok = {"ev": "batch.swap", "t": 1, "w": 2, "pid": 3, "role": "worker", "inst": "D",
          "i1": 0, "i2": 1, "req1": "a", "req2": "b"}
    assert schema.validate_event(ok) is None
    bad = dict(ok)
    del bad["req2"]
    assert schema.validate_event(bad) == "batch.swap: missing field(s) req2"
    assert "unknown event kind" in schema.validate_event({"ev": "nope"})
