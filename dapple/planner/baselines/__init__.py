"""Plans to compare against: PipeDream's planner and an exhaustive search of small instances."""
