"""Shared test settings: torch (where imported) is pinned to one thread by the Makefile's
environment; nothing here mocks the network or the disk."""
