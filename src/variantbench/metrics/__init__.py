"""Statistics over query logs: latency percentiles, throughput, output quality."""
