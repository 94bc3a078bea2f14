"""sidecar: run hang-prone tools from a PostgreSQL queue under a lease.

A job is only running while a live owner holds a lease on it (the article in
``shared/seed``, restated as rules P1-P25 in ``shared/PROTOCOL.md``).
"""

__version__ = "0.1.0"
