import functools
import json
import os
import urllib.request
from pathlib import Path

import pytest

import procs
from procs import start_proxy, start_scripted
from waits import SCALE

# grpcio >= 1.81 restarts its poller in a child forked while a channel or server of this process is open, and
# the child aborts on the closed epoll fd before it execs (grpc/grpc#43055): tests that run an in-process gRPC
# receiver beside the processes they start (test_collector_e2e) lost a simulated instance that way. Fork
# support is only for children that go on using gRPC; every child here execs.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """pytest-timeout's per-test bound (pyproject's `timeout`) stretches with PDPROXY_TEST_TIMEOUT_SCALE too,
    unless --timeout or PYTEST_TIMEOUT names one."""
    ini = config.getini("timeout")
    if SCALE != 1 and ini and config.getoption("timeout", None) is None and not os.environ.get("PYTEST_TIMEOUT"):
        config.option.timeout = float(ini) * SCALE


OWN_PROCS = pytest.StashKey[list]()
# The Go-built tools in the order .ci/run builds them in the background, each with what names it in a test
# module; a module runs after the tests needing none, in the order of the last tool it names (see go_rank).
GO_TOOLS = (("collector", ("gotools", "collector_binary", "running_collector")),
            ("grafana-schema", ("build-grafana-schema",)),
            ("jaeger", ("jaeger",)),
            ("prometheus 3", ("build-prometheus", "prometheus3")),
            ("kube-apiserver", ("kube_apiserver", "build-kube-apiserver")))
GO_WAIT_TIMEOUT = 1800  # seconds: a test that needs a tool may first wait for its cold build


@functools.cache
def go_rank(path: str) -> int:
    """0 for a test module that needs no Go-built tool, else 1 + the place of the last tool it names."""
    text = Path(path).read_text(errors="replace")
    return max((rank for rank, (_, names) in enumerate(GO_TOOLS, 1) if any(n in text for n in names)), default=0)


def pytest_collection_modifyitems(session, config, items):
    """The tests needing a Go-built tool run last, in the order the tools are built, so the suite does not wait
    for the builds (.ci/run); their bound covers a wait for a cold build."""
    items.sort(key=lambda item: go_rank(str(item.path)))
    for item in items:
        if go_rank(str(item.path)):
            item.add_marker(pytest.mark.timeout(GO_WAIT_TIMEOUT))


@pytest.fixture(scope="session", autouse=True)
def _test_files(tmp_path_factory):
    """Each test's process logs and tools' directories under pytest's base temporary directory (procs.FILES)."""
    procs.FILES.factory = tmp_path_factory


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    procs.FILES.begin_test(f"{item.path.stem}-{item.name}")


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    with procs.FILES.fixture(fixturedef.scope):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test keeps its files, and its report names them; after its teardown, a test's stopped processes'
    logs go unless kept."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        kept = procs.FILES.keep()
        if kept:
            report.sections.append(("files kept (process logs, tools' directories)", "\n".join(map(str, kept))))
    if report.when == "teardown":
        procs.FILES.end_test()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Note the processes the test itself starts (not its fixtures, which may outlive it)."""
    first = len(procs.STARTED)
    yield
    item.stash[OWN_PROCS] = procs.STARTED[first:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's fixtures are torn down, kill the group of every process the test started that still runs
    (a failing test's too), and say which: a passing test should have stopped them itself."""
    yield
    left = procs.kill_groups(item.stash.get(OWN_PROCS, []))
    if left:
        item.warn(pytest.PytestWarning(f"{item.nodeid} left running (now killed): {left}"))


def pytest_sessionfinish(session, exitstatus):
    """Whatever a fixture left running, and the files no failed test kept."""
    procs.kill_groups(procs.STARTED)
    procs.FILES.end_session()


class Scripted:
    """Handle on a scripted backend process: queue answers, read the journal."""

    def __init__(self, proc, url):
        self.proc, self.url = proc, url

    def _call(self, method, path, data=None):
        req = urllib.request.Request(self.url + path, method=method,
                                     data=None if data is None else json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def script(self, *steps):
        self._call("POST", "/_script", list(steps))

    def journal(self):
        return self._call("GET", "/_journal")

    def reset(self):
        self._call("POST", "/_reset", {})


@pytest.fixture(scope="session")
def kube_apiserver():
    """A real kube-apiserver on a real etcd (tests/kube.py), started once for the session's Kubernetes tests."""
    from kube import KubeCluster

    # (a session fixture's setup runs outside this conftest's pytest_fixture_setup, which only wraps the
    # fixtures of nodes below tests/: say here that its directory outlives the test)
    with procs.FILES.fixture("session"):
        cluster = KubeCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def started():
    """What a test starts (append each process), stopped at its end, also when a later start fails."""
    procs = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


@pytest.fixture(name="procs")
def procs_started(started):
    """The same list, by the name some test files use."""
    return started


@pytest.fixture(scope="module")
def scripted_pd():
    """Scripted prefill + decode behind a proxy (retries off so each fault shows as itself)."""
    procs = []
    try:
        p = Scripted(*start_scripted("prefill"))
        d = Scripted(*start_scripted("decode"))
        procs += [p.proc, d.proc]
        proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--prefill-retries", "0",
                                 "--decode-retries", "0", "--read-timeout", "2", "--health-check-interval", "0",
                                 "--eject-after-failures", "0")
        procs.append(proxy)
        yield p, d, url, proxy
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def pd(scripted_pd):
    p, d, url, proxy = scripted_pd
    p.reset()
    d.reset()
    return scripted_pd
