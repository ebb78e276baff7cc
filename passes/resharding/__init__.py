"""The resharding planner: one tensor's move between two meshes, from unit communication tasks to a lowered, verified program (paper §2-§3)."""
