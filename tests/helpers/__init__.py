"""Helpers shared by the tests: fakes, recorded-harness fixtures, CI requirements."""
