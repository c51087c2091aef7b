"""How the suite spreads over pytest-xdist workers, and which tests make the quick tier.

Workers (`bash tools/run_tests.sh` runs two on two cores): a test module is one unit of work, so its
module-scoped fixtures (shared runs, clusters) are built once, on the worker that runs it. Modules
that start machine-wide services -- a Slurm cluster on localhost, hosts made from network
namespaces -- form one unit together and run one after another on one worker. Units go out longest
first by their recorded seconds, so the workers finish close together. Most tests spend much of
their time in one process (one rank, a command-line tool, a process starting, Slurm's queue), so
two workers on two cores take about 40% off the suite's wall time.

The quick tier (`bash tools/run_tests.sh --quick`, i.e. `-m "not slow"`): a test is marked `slow`
when its recorded time is over QUICK_S seconds, or when it needs an expensive shared fixture: a
module- or session-scoped fixture of ours (a shared training run, a cluster) whose users' recorded
times add up to more than SHARED_QUICK_S (a shared fixture's cost lands on the first test that asks
for it, whatever the tier; the cheap ones -- test_model's tp runs -- stay in the quick tier).

The recorded seconds are tests/durations.json ({test id: seconds, setup + call + teardown}), written
by a whole run with CPLM_RECORD_DURATIONS set:
    CPLM_RECORD_DURATIONS=tests/durations.json bash tools/run_tests.sh
A test missing from it (a new one) counts as quick and short until the file is written again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
QUICK_S = 4.0
SHARED_QUICK_S = 45.0

# Modules that share a machine-wide resource: run as one unit, in this order.
SERIAL = {"tests/test_launchers.py": "slurm", "tests/test_multihost.py": "slurm", "tests/test_chaos.py": "slurm",
          "tests/test_scaling.py": "slurm"}


def recorded() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (FileNotFoundError, ValueError):
        return {}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or its SERIAL group."""
    module = nodeid.split("::", 1)[0]
    return SERIAL.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByModule(config, log)


def order_longest_first(items: list, seconds: dict[str, float]) -> None:
    """Items grouped by unit, the longest unit first; a unit's items keep their collected order
    (the modules of a SERIAL group in the group's order)."""
    unit_s: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        unit = unit_of(item.nodeid)
        unit_s[unit] = unit_s.get(unit, 0.0) + seconds.get(item.nodeid, 0.0)
        first_seen.setdefault(unit, i)
    position = {module: i for i, module in enumerate(SERIAL)}

    def key(indexed):
        i, item = indexed
        unit = unit_of(item.nodeid)
        return -unit_s[unit], first_seen[unit], position.get(item.nodeid.split("::", 1)[0], 0), i

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def shared_fixtures(item) -> set[tuple[str, str]]:
    """The module- or session-scoped fixtures defined in tests/ that the test asks for, as (name, where)."""
    info = getattr(item, "_fixtureinfo", None)
    return {(name, d.baseid) for name, defs in (info.name2fixturedefs.items() if info is not None else ())
            for d in defs if d.scope in ("module", "session") and d.baseid.startswith("tests")}


def mark_slow(items: list, seconds: dict[str, float]) -> None:
    users: dict[tuple[str, str], float] = {}
    for item in items:
        for fixture in shared_fixtures(item):
            users[fixture] = users.get(fixture, 0.0) + seconds.get(item.nodeid, 0.0)
    for item in items:
        if seconds.get(item.nodeid, 0.0) > QUICK_S or any(users[f] > SHARED_QUICK_S for f in shared_fixtures(item)):
            item.add_marker(pytest.mark.slow)


class DurationRecorder:
    """With CPLM_RECORD_DURATIONS=PATH: each test's setup + call + teardown seconds, written to PATH
    as the session ends (on the controller under xdist: it sees every worker's reports)."""

    def __init__(self, path: str):
        self.path, self.seconds = Path(path), {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = round(self.seconds.get(report.nodeid, 0.0) + report.duration, 2)

    def pytest_sessionfinish(self, session):
        if self.seconds:  # registered on the controller only (`register`)
            self.path.write_text(json.dumps(dict(sorted(self.seconds.items())), indent=0) + "\n")


def register(config) -> None:
    path = os.environ.get("CPLM_RECORD_DURATIONS")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(path), "cplm-durations")
