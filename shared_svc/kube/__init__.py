"""The only code that talks to the API server: caches, writer, Events, Lease."""
