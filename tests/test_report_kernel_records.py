"""The optimize report's fusions share one kernel record per distinct kernel (cost_model.decide._kernel_record):
each record reads exactly as the kernel's own to_dict, and the report holds no record twice."""

from __future__ import annotations

from pathlib import Path

import npufuse

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _records(result):
    return [r for r in result.details.records if r.decision is not None]


def test_shared_kernel_records_read_as_each_kernel_alone() -> None:
    result = npufuse.optimize(str(EXAMPLES / "bert_tiny.onnx"), verify=False)
    records = _records(result)
    assert len(records) > 2   # repeated layers: the pricing cache renames one decision per layer
    shared: dict = {}
    assert [r.to_dict(shared) for r in records] == [r.to_dict() for r in records]
    assert len(shared) < sum(len(r.decision.unfused) + len(r.decision.fused) for r in records)


def test_report_holds_no_record_twice() -> None:
    result = npufuse.optimize(str(EXAMPLES / "bert_tiny.onnx"), verify=False)
    seen: set[int] = set()

    def walk(doc: object) -> None:
        if isinstance(doc, (dict, list)):
            assert id(doc) not in seen   # readable_document copied every shared record
            seen.add(id(doc))
            for v in doc.values() if isinstance(doc, dict) else doc:
                walk(v)

    walk(result.report)
