"""Device memory that steps read and write: the paged KV cache, its sizing,
the page layout of a step, and the attention backends over it. Knows no
other room of the engine."""
