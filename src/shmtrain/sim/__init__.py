"""Simulation: the alpha-beta-gamma cost model and the schedule simulator (SCALE)."""
