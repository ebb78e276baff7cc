"""Cross-mesh resharding benchmarks: the paper's Table 2 and Fig. 5 cases."""
