"""Benchmarks that print JSON and the machine they ran on."""
