"""Every use of a private attribute of torch, Opacus or transformers, one module per library."""
