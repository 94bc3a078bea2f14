"""The pure protocol: the data types (model), the words for how things end (vocabulary), the
verdict on an attempt, one lease's state machine, the clock of ownership, JSON text kept
exact, masking of secrets, a tool's checked result, the errors, host shortages, flow-control
limits, the caller's enqueue options and the pure parsers of input. No I/O: no database, no
process, no network.

Import rule: Imports nothing else of the sidecar (only ``sidecar`` itself for its version).
"""
