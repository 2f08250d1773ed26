"""The planted-fault table stays in step with the source: every fault's snippet occurs exactly
once in its file, planting it changes the file, and its tests exist."""
from __future__ import annotations

from pathlib import Path

from tests.faults.run_faults import snippet_problems
from tests.faults.table import FAULTS

REPO = Path(__file__).resolve().parents[2]


def test_every_snippet_occurs_once_and_the_tests_exist():
    assert len(FAULTS) >= 30 and len({f.name for f in FAULTS}) == len(FAULTS)
    assert snippet_problems(REPO) == []
    for fault in FAULTS:
        assert fault.old != fault.new, fault.name
        for test in fault.tests:
            path, _, name = test.partition('::')
            assert (REPO / path).is_file(), (fault.name, test)
            assert not name or f'def {name}(' in (REPO / path).read_text(), (fault.name, test)
