"""gdn-serve: a gRPC service for the decode step of Gated Delta Net layers.

Data flows one way: request -> `validation` (tensors) -> `scheduler` (batches) -> `backends`
(the state pool and the math) -> reply. `servicer` is the thin gRPC layer, `server` wires it up,
`cli` is the command line.
"""
__version__ = "0.1.0"
