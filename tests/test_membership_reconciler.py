"""The reconciler's rules on their own (issue 53, item 1): the union of the sources, drain and restore, readiness
kept apart from removal, a new incarnation. The proxy-level behaviour is in test_membership_admin.py and
test_membership_file.py."""

import asyncio

import pytest

from pdproxy.membership import member
from pdproxy.membership.reconciler import DRAINING, Reconciler
from pdproxy.pool import Pool


class Recording:
    """A cluster of two pools that records what the reconciler asks of it."""

    def __init__(self):
        self.pools = {"prefill": Pool("prefill", []), "decode": Pool("decode", [])}
        self.calls = []

    async def add(self, m, source):
        self.calls.append(("add", m.url, source))
        return self.pools[m.role].add(m.url)

    async def update(self, instance, old, new):
        self.calls.append(("update", new.url, old.identity, new.identity))

    async def remove(self, instance, m):
        self.calls.append(("remove", m.url))
        self.pools[m.role].remove(instance)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


D1, D2 = "http://10.0.0.1:8200", "http://10.0.0.2:8200"


def test_one_entry_for_an_instance_two_sources_list_and_discovery_never_removes_the_flags():
    async def go():
        cluster = Recording()
        rec = Reconciler(cluster, grace=5)
        rec.publish("flags", [member("decode", D1)])
        rec.publish("kubernetes", [member("decode", D1, identity="uid-1"), member("decode", D2)])
        await rec.settled()
        assert [c for c in cluster.calls if c[0] == "add"] == [("add", D1, "flags"), ("add", D2, "kubernetes")]
        assert rec.entry("decode", D1).sources == ("flags", "kubernetes")
        assert rec.entry("decode", D1).member.identity is None  # the flags' description wins
        rec.entry("decode", D2).instance.inflight = 1
        rec.publish("kubernetes", [])  # discovery lost both
        await rec.settled()
        assert rec.entry("decode", D1).state == "active"  # still the flags'
        assert rec.entry("decode", D2).state == DRAINING
        rec.entry("decode", D2).instance.inflight = 0
        await asyncio.sleep(0.3)  # nothing in flight: removed at the drain's next look
        assert rec.entry("decode", D2) is None and ("remove", D2) in cluster.calls
        assert [i.url for i in cluster.pools["decode"].instances] == [D1]
        await rec.stop()
    run(go())


def test_a_draining_instance_waits_for_its_requests_and_comes_back_if_listed_again():
    async def go():
        cluster = Recording()
        rec = Reconciler(cluster, grace=5)
        rec.publish("admin", [member("decode", D1), member("decode", D2)])
        await rec.settled()
        d2 = rec.entry("decode", D2).instance
        d2.inflight = 2
        rec.publish("admin", [member("decode", D1)])
        await rec.settled()
        await asyncio.sleep(0.3)
        assert rec.entry("decode", D2).state == DRAINING and d2.draining  # its requests still run
        assert d2 not in cluster.pools["decode"].candidates()
        rec.publish("admin", [member("decode", D1), member("decode", D2)])  # back before it drained
        await rec.settled()
        assert rec.entry("decode", D2).state == "active" and not d2.draining
        assert ("remove", D2) not in cluster.calls
        rec.publish("admin", [member("decode", D1)])
        await rec.settled()
        d2.inflight = 0
        await asyncio.sleep(0.3)
        assert ("remove", D2) in cluster.calls
        await rec.stop()
    run(go())


def test_the_grace_period_bounds_a_drain():
    async def go():
        cluster = Recording()
        rec = Reconciler(cluster, grace=0.3)
        rec.publish("file", [member("decode", D1)])
        await rec.settled()
        rec.entry("decode", D1).instance.inflight = 1  # a request that never ends
        rec.publish("file", [])
        await rec.settled()
        await asyncio.sleep(0.7)
        assert ("remove", D1) in cluster.calls and rec.entry("decode", D1) is None
        await rec.stop()
    run(go())


def test_not_ready_keeps_the_instance_and_terminating_drains_it():
    async def go():
        cluster = Recording()
        rec = Reconciler(cluster, grace=5)
        rec.publish("kubernetes", [member("decode", D1, identity="a"), member("decode", D2, identity="b")])
        await rec.settled()
        for flaps in range(5):  # a readiness probe flapping: no re-add, no removal, no resubscription
            rec.publish("kubernetes", [member("decode", D1, identity="a", ready=flaps % 2 == 1),
                                       member("decode", D2, identity="b")])
            await rec.settled()
        d1 = rec.entry("decode", D1).instance
        assert not d1.ready and d1 not in cluster.pools["decode"].candidates()
        assert [c[0] for c in cluster.calls] == ["add", "add"]
        rec.publish("kubernetes", [member("decode", D1, identity="a", ready=False, terminating=True),
                                   member("decode", D2, identity="c")])  # a deleted pod; a new pod at D2's IP
        await rec.settled()
        await asyncio.sleep(0.3)
        assert ("remove", D1) in cluster.calls
        assert ("update", D2, "b", "c") in cluster.calls and rec.entry("decode", D2).state == "active"
        await rec.stop()
    run(go())


def test_a_member_of_a_role_without_a_pool_is_ignored_not_retried_forever():
    async def go():
        cluster = Recording()
        del cluster.pools["prefill"]
        rec = Reconciler(cluster, grace=5, roles=["decode"])
        rec.publish("file", [member("prefill", D1), member("decode", D2)])
        await rec.settled()
        assert [c[1] for c in cluster.calls] == [D2]
        await rec.stop()
    run(go())


@pytest.mark.parametrize("url,why", [("ftp://h:1", "scheme"), ("http://user:pw@h:1", "credentials"),
                                     ("http://h:1/v1", "path"), ("", "non-empty"), ("http://:80", "host")])
def test_bad_urls_are_refused_with_the_reason(url, why):
    with pytest.raises(ValueError, match=why):
        member("decode", url)
