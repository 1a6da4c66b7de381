"""The planner's search (formulas 4-5): a DP over stage splits, replication and Fresh/Append/Scatter placement."""
