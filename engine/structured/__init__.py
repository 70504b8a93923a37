"""Grammar-constrained decoding: a request's constraint (StructuredSpec), compiled once per spec
by a grammar backend (xgrammar), matched per sequence in the engine core, applied as a token
bitmask in the batched sampler."""
