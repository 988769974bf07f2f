"""One module per command family; see shared_svc.cli."""
