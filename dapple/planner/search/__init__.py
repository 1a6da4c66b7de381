"""The planner's search (formulas 4-5): read reference.py (paper IV-C as it reads), then dp.py (the same DP, fast)."""
