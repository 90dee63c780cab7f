"""gdn-serve: a gRPC service for the decode step of Gated Delta Net layers.

Data flows one way: request -> `validation` (checked inputs) -> `scheduler` (launches) ->
`backends` (the state pool and the math) -> reply. `servicer` is the thin gRPC layer, `server`
wires one process up, `supervisor` runs several on a host, `cli` is the command line. Importing
the package changes nothing in the process or its environment.
"""

__version__ = "0.1.0"
