"""The coordinator: the authoritative registry of a run's stage servers and their leases."""
