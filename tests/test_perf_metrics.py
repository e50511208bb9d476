"""The loop histograms: a request's sorted gaps observed in one go land exactly where one-by-one would."""

import random

from pdproxy.telemetry.metrics import HistogramSeries, Stamp
from pdproxy.telemetry.names import GAP_BUCKETS


def test_sorted_bulk_observation_matches_one_by_one():
    rng = random.Random(7)
    for _ in range(200):
        values = [rng.choice([rng.random() * 0.05, rng.choice(GAP_BUCKETS), rng.random() * 100, 0.0])
                  for _ in range(rng.randint(0, 300))]
        one, bulk = HistogramSeries(GAP_BUCKETS), HistogramSeries(GAP_BUCKETS)
        stamp = Stamp("t", 1.0)
        for v in values:
            one.observe(v, stamp if v == max(values) else None)
        bulk.observe_sorted(sorted(values), stamp)
        assert bulk.counts == one.counts
        assert abs(bulk.sum - one.sum) < 1e-9
        # the exemplar on the largest value's bucket, as observing it alone would put it
        assert (bulk.stamps, bulk.values) == (one.stamps, one.values)
