"""The loop histograms: a request's sorted gaps observed in one go land exactly where one-by-one would."""

import random

from pdproxy.telemetry.metrics import HistogramSeries
from pdproxy.telemetry.names import GAP_BUCKETS


def test_sorted_bulk_observation_matches_one_by_one():
    rng = random.Random(7)
    for _ in range(200):
        values = [rng.choice([rng.random() * 0.05, rng.choice(GAP_BUCKETS), rng.random() * 100, 0.0])
                  for _ in range(rng.randint(0, 300))]
        one, bulk = HistogramSeries(GAP_BUCKETS), HistogramSeries(GAP_BUCKETS)
        for v in values:
            one.observe(v)
        bulk.observe_sorted(sorted(values))
        assert bulk.counts == one.counts
        assert abs(bulk.sum - one.sum) < 1e-9
