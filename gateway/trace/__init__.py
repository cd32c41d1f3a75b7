"""Real workload shapes: private trace capture, statistics, replay and offline simulation.

Submodules are imported on demand; importing this package does nothing.
"""
