"""A pipeline step simulated from task durations: the cost model, the event simulator and its timelines."""
