"""The store: where the database is and how to connect (db), the named SQL and the migrations
(queries, sql/), and the only modules that run the queue's SQL (store and the stores of each
audience).

Import rule: Imports only sidecar.protocol and sidecar.runtime.
"""
