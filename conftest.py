"""Runs before any test or doctest module: 8 virtual CPU devices for the whole session."""

import parstrat.testing

parstrat.testing.use_cpu_devices(8)
